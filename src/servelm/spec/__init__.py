"""Speculative decoding: guess a request's next tokens cheaply, verify them in one target pass.

    runner step N:  forward ─▶ sample ─▶ verify (accept the longest prefix of the drafts that the
                    target's own samples agree with, + one target token) ─▶ proposer.propose()
                    ─▶ ModelOutput.draft_token_ids
    scheduler:      update() appends the accepted tokens, keeps the drafts on the request;
                    schedule() asks the controller for k per request (0..drafts on hand), schedules
                    1 + k tokens for it and sends the k drafts in SchedulerOutput.

Pieces, one job each:
- SpeculativeConfig (`--speculative-config` JSON, vLLM's keys) lives in servelm.config with the other slices.
- `proposer.py`   the Proposer interface and the registry of methods.
- `ngram.py`      prompt lookup over the request's own tokens (vLLM's prompt_lookup_min/max).
- `suffix.py`     a bounded suffix index over the request's tokens and other requests' outputs.
- `controller.py` the goodput controller: k per request from measured acceptance and step cost.
Acceptance of drafts against the target's samples is torch work: servelm.worker.spec_verify.
"""
