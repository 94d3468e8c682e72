"""Stop conditions on token ids, checked after each appended output token.

Stop *strings* are not here: they need text, which lives in the API process (it
detokenizes, finds the string and aborts the request in the core).
"""

from __future__ import annotations

from collections.abc import Collection

from servelm.scheduler.request import Request, RequestStatus


def check_stop(
    request: Request, eos_token_ids: Collection[int], max_model_len: int
) -> tuple[RequestStatus, int | None] | None:
    """(finished status, stop token id or None) if the last output token ends the request.

    - EOS (unless ignore_eos) and stop_token_ids stop only once min_tokens tokens precede
      them, matching the sampler, which masks them while len(output) < min_tokens.
    - A stop token that lands exactly on the length limit reports STOP, not LENGTH: the
      model chose to end there.
    - max_tokens and max_model_len (prompt + output) report LENGTH.
    """
    params = request.sampling_params
    last = request.output_token_ids[-1]
    if request.num_output_tokens > params.min_tokens:
        if not params.ignore_eos and last in eos_token_ids:
            return RequestStatus.FINISHED_STOPPED, None
        if last in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, last
    if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
        return RequestStatus.FINISHED_LENGTH, None
    if request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH, None
    return None
