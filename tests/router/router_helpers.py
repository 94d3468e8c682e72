ROUTER_KEY = "router-key-1"  # the e2e router's API key (replicas run without one)
