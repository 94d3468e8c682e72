"""The OpenAI API's edges shared by every HTTP front servelm runs (the API server and the router):
the error body, the API-key check, chat-message normalisation. Imports no server or engine code."""
