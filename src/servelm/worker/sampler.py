"""Sampler: one token per row from the model's last-position logits.

Order of processing (vLLM's):

    raw logits ─┬─▶ log_softmax ──▶ logprobs (of the RAW logits, vLLM's "raw_logprobs")
                └─▶ grammar mask, banned ids → -inf ─▶ repetition penalty ─▶ frequency/presence penalties
                      ├─▶ greedy rows: argmax
                      └─▶ / temperature ─▶ min_p ─▶ top-k ─▶ top-p ─▶ exponential race

Logprobs are those of the model's distribution, before temperature, penalties and
filters: a sampled token outside what the model found likely shows up as such, and
evaluation harnesses (loglikelihood) get the model's own numbers.

Sampling is the exponential race: argmax(probs / q) with q ~ Exp(1) per vocab entry
picks token i with probability probs[i]. Its noise can be drawn per row, so a row
with its own torch.Generator gets the same tokens whatever else shares the batch and
whichever row it sits in, provided the generator advances exactly once per step
(one draw of `vocab_size` exponentials) and the row's logits are the same.

A seeded row's noise comes from its own generator on the CPU: every seeded row of the step
is drawn into one host tensor and sent to the device in one copy. So the same seed gives the
same noise on CPU and CUDA, and with the same logits the same token (bar a float rounding
that flips a filter's cut-off or a near-tie between devices); unseeded rows draw on the device.

Everything else stays on `logits.device`; no Python loop touches per-row math (the only loop
draws the seeded rows' noise). Nothing here reads a device value back: the host gets the
step's results through `SamplerOutput.to_host`, ONE device-to-host copy of everything packed
into one tensor (worker/host_transfer.py says why that matters on a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from servelm.datatypes import PositionLogprobs, TokenLogprob
from servelm.worker.host_transfer import copy_to_host, host_noise_buffer, to_device
from servelm.worker.sampling_metadata import SamplingMetadata


@dataclass
class LogprobsTensors:
    """Raw-logit logprobs for one step. `n` = the batch's largest request; rows slice their own."""

    sampled_token_ids: torch.Tensor  # [B] long, the same tensor as SamplerOutput's
    sampled_logprobs: torch.Tensor  # [B] float32, logprob of the sampled token
    sampled_ranks: torch.Tensor  # [B] long, 1 + number of tokens strictly more likely
    top_token_ids: torch.Tensor  # [B, n] long, by descending logprob
    top_logprobs: torch.Tensor  # [B, n] float32

    def row(self, i: int, num_logprobs: int) -> PositionLogprobs:
        """Row i with its own `num_logprobs` alternatives (one sync per row on a GPU: see cpu())."""
        if num_logprobs > self.top_token_ids.shape[1]:
            raise ValueError(f"row asks for {num_logprobs} logprobs, only {self.top_token_ids.shape[1]} computed")
        ids = self.top_token_ids[i, :num_logprobs].tolist()
        lps = self.top_logprobs[i, :num_logprobs].tolist()
        # Alternatives are ranked by position; ties share no rank (as vLLM).
        return PositionLogprobs(
            chosen=TokenLogprob(
                token_id=int(self.sampled_token_ids[i]),
                logprob=float(self.sampled_logprobs[i]),
                rank=int(self.sampled_ranks[i]),
            ),
            top=[TokenLogprob(token_id=t, logprob=lp, rank=r + 1) for r, (t, lp) in enumerate(zip(ids, lps))],
        )

    def pack(self) -> torch.Tensor:
        """All five as one [B, 3 + 2n] float64 tensor, columns: sampled id | its logprob | its rank |
        n top ids | n top logprobs. Every value is exact in float64 (ids and ranks are integers
        below 2^53, float32 widens exactly), so `unpack` gives back the same numbers."""
        columns = [self.sampled_token_ids, self.sampled_logprobs, self.sampled_ranks]
        singles = torch.stack([c.to(torch.float64) for c in columns], dim=1)  # [B, 3]
        return torch.cat([singles, self.top_token_ids.to(torch.float64), self.top_logprobs.to(torch.float64)], dim=1)

    @classmethod
    def unpack(cls, packed: torch.Tensor) -> LogprobsTensors:
        """The inverse of `pack`, on whatever device `packed` is."""
        n = (packed.shape[1] - 3) // 2
        return cls(
            sampled_token_ids=packed[:, 0].to(torch.long),
            sampled_logprobs=packed[:, 1].to(torch.float32),
            sampled_ranks=packed[:, 2].to(torch.long),
            top_token_ids=packed[:, 3 : 3 + n].to(torch.long),
            top_logprobs=packed[:, 3 + n :].to(torch.float32),
        )

    def cpu(self) -> LogprobsTensors:
        """On the host, in one device-to-host copy (packed)."""
        return LogprobsTensors.unpack(copy_to_host(self.pack()))

    def to_position_logprobs(self, num_logprobs: list[int | None]) -> list[PositionLogprobs | None]:
        """Every row, in one copy to the host (not one per row or per tensor); None where none asked."""
        host = self.cpu()
        return [None if n is None else host.row(i, n) for i, n in enumerate(num_logprobs)]


@dataclass
class HostSamples:
    """A step's sampler results on the host, one entry per row."""

    token_ids: list[int]
    logprobs: list[PositionLogprobs | None]  # [] when no row asked for logprobs


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] long
    logprobs: LogprobsTensors | None  # None when no row asked for logprobs

    def to_host(self, num_logprobs: list[int | None]) -> HostSamples:
        """Sampled ids and the asked-for logprobs (`num_logprobs[i]` alternatives for row i, None:
        none) on the host, in ONE device-to-host copy: the step's only wait for the device."""
        if self.logprobs is None:
            return HostSamples(copy_to_host(self.sampled_token_ids).tolist(), [])
        host = self.logprobs.cpu()  # its sampled ids are this output's
        rows = [None if n is None else host.row(i, n) for i, n in enumerate(num_logprobs)]
        return HostSamples(host.sampled_token_ids.tolist(), rows)


class Sampler:
    """Stateless; per-request state (generators, history) comes in through SamplingMetadata."""

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        # logits: [B, V], any float dtype; never modified in place.
        _check_shape(logits, metadata)
        raw_logprobs = (
            _compute_logprobs(logits, metadata.max_num_logprobs) if metadata.max_num_logprobs is not None else None
        )

        if (metadata.all_greedy and metadata.no_penalties and metadata.banned_rows is None
                and metadata.allowed_bitmask is None):  # fmt: skip
            sampled = logits.argmax(dim=-1)
        else:
            penalised = self.apply_penalties(logits, metadata)
            if metadata.all_greedy:
                sampled = penalised.argmax(dim=-1)
            else:
                probs = self.probs(penalised, metadata, penalised=True)
                sampled = _exponential_race(probs, metadata)
                if not metadata.all_random:
                    assert metadata.greedy_mask is not None
                    sampled = torch.where(metadata.greedy_mask, penalised.argmax(dim=-1), sampled)

        logprobs = _finish_logprobs(raw_logprobs, sampled) if raw_logprobs is not None else None
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    @staticmethod
    def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Grammar masks, banned ids, repetition, frequency and presence penalties, on a float32
        copy. [B, V]"""
        x = logits.to(torch.float32, copy=True)
        batch, vocab = x.shape
        if metadata.allowed_bitmask is not None:
            x.masked_fill_(~unpack_bitmask(metadata.allowed_bitmask, vocab), float("-inf"))
        if metadata.banned_rows is not None:
            neg_inf = x.new_full((), float("-inf"))  # filled on the device: no host copy
            x.index_put_((metadata.banned_rows, metadata.banned_token_ids), neg_inf)
        if metadata.no_penalties:
            return x
        assert metadata.output_token_ids is not None
        # Column `vocab` collects the padding and is dropped.
        out_ids = metadata.output_token_ids  # [B, L_out]
        counts = torch.zeros(batch, vocab + 1, dtype=torch.float32, device=x.device)
        counts.scatter_add_(1, out_ids, torch.ones(out_ids.shape, dtype=torch.float32, device=x.device))
        counts = counts[:, :vocab]  # [B, V] occurrences in the output so far
        if metadata.repetition_penalty is not None:
            assert metadata.prompt_token_ids is not None
            seen = torch.zeros(batch, vocab + 1, dtype=torch.bool, device=x.device)
            seen.scatter_(1, metadata.prompt_token_ids, True)
            seen = seen[:, :vocab] | (counts > 0)  # [B, V]
            penalty = metadata.repetition_penalty.unsqueeze(1)  # [B, 1]
            # HF/CTRL: push seen tokens towards "less likely" whatever the logit's sign.
            x = torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x)
        if metadata.frequency_penalty is not None:
            assert metadata.presence_penalty is not None
            x = x - metadata.frequency_penalty.unsqueeze(1) * counts
            x = x - metadata.presence_penalty.unsqueeze(1) * (counts > 0).to(torch.float32)
        return x

    def probs(self, logits: torch.Tensor, metadata: SamplingMetadata, penalised: bool = False) -> torch.Tensor:
        """The distribution the random rows sample from: [B, V] float32, zeros outside the support."""
        return self.filtered_logits(logits, metadata, penalised).softmax(dim=-1)

    def filtered_logits(
        self, logits: torch.Tensor, metadata: SamplingMetadata, penalised: bool = False
    ) -> torch.Tensor:
        """Tempered logits with -inf outside the support (min_p, top-k, top-p). [B, V] float32

        The support is exactly the finite entries, even where softmax underflows to 0.
        Greedy rows come out at temperature 1 with no filter; the caller ignores them.
        `penalised=False` applies banned ids and penalties first.
        """
        if metadata.temperature is None:
            raise ValueError("all rows are greedy: there is no distribution to sample from")
        x = logits if penalised else self.apply_penalties(logits, metadata)
        x = x / metadata.temperature.unsqueeze(1)  # [B, V]
        if metadata.min_p is not None:
            p = x.softmax(dim=-1)
            threshold = metadata.min_p.unsqueeze(1) * p.amax(dim=-1, keepdim=True)  # [B, 1]
            x = x.masked_fill(p < threshold, float("-inf"))
        if metadata.top_k is not None or metadata.top_p is not None:
            x = _apply_top_k_top_p(x, metadata.top_k, metadata.top_p)
        return x


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [B, W] bitmask (bit i of word w: token 32 w + i) → bool [B, vocab_size] allowed; tokens
    past the mask's 32 W are not allowed."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).to(torch.bool).flatten(1)  # [B, 32 W]
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size]
    return torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]), value=False)


def _check_shape(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    if logits.dim() != 2 or logits.shape != (metadata.num_rows, metadata.vocab_size):
        raise ValueError(
            f"logits shape {tuple(logits.shape)} != (num_rows, vocab_size) = "
            f"({metadata.num_rows}, {metadata.vocab_size})"
        )


def _apply_top_k_top_p(x: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """Mask to -inf what top-k (k: [B] long) then top-p (p: [B]) drop; one sort serves both."""
    vocab = x.shape[1]
    sorted_x, order = x.sort(dim=-1)  # ascending: [B, V] each
    if k is not None:
        # The k-th largest sits at ascending position V - k; ties with it are kept.
        kth = sorted_x.gather(1, (vocab - k).unsqueeze(1))  # [B, 1]
        sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    if p is not None:
        # Ascending cumsum at j = 1 - (mass of tokens more likely than j). Dropping j when
        # that is <= 1 - p keeps exactly the smallest top set whose mass reaches p.
        cum = sorted_x.softmax(dim=-1).cumsum(dim=-1)  # [B, V]
        drop = cum <= (1.0 - p).unsqueeze(1)
        drop[:, -1] = False  # the most likely token always survives
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(1, order, sorted_x)


def _exponential_race(probs: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """argmax(probs / q), q ~ Exp(1): a draw from each row of probs ([B, V]) → [B] long."""
    q = torch.empty_like(probs)
    if len(metadata.generators) < probs.shape[0]:
        q.exponential_()  # one shared draw from the device's default generator
    host_rows = [row for row, gen in metadata.generators.items() if gen.device.type == "cpu"]
    if host_rows:
        # The seeded rows' noise, each from its own CPU generator, sent in one copy: the same
        # numbers whatever device samples (module doc).
        noise = host_noise_buffer(len(host_rows), q.shape[1], q.device)  # [S, V]
        for i, row in enumerate(host_rows):
            noise[i].exponential_(generator=metadata.generators[row])
        q[to_device(host_rows, torch.long, q.device)] = noise.to(q.device, non_blocking=True)
    for row, gen in metadata.generators.items():
        if gen.device.type == "cpu":
            continue
        if gen.device != q.device:
            raise ValueError(f"row {row}'s generator is on {gen.device}, the logits on {q.device}: use a CPU one")
        q[row].exponential_(generator=gen)  # a caller's generator on the logits' device draws there
    # q == 0 has probability ~2^-24 per entry; keep it from turning 0/0 into NaN.
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return (probs / q).argmax(dim=-1)


def _compute_logprobs(logits: torch.Tensor, num_top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """log_softmax of the raw logits ([B, V] float32) and its top-n ids / values ([B, n])."""
    lp = logits.to(torch.float32).log_softmax(dim=-1)
    top_lp, top_ids = lp.topk(num_top, dim=-1)  # sorted descending
    return lp, top_ids, top_lp


def _finish_logprobs(
    parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor], sampled: torch.Tensor
) -> LogprobsTensors:
    lp, top_ids, top_lp = parts
    sampled_lp = lp.gather(1, sampled.unsqueeze(1))  # [B, 1]
    ranks = (lp > sampled_lp).sum(dim=-1) + 1  # [B]
    return LogprobsTensors(
        sampled_token_ids=sampled,
        sampled_logprobs=sampled_lp.squeeze(1),
        sampled_ranks=ranks,
        top_token_ids=top_ids,
        top_logprobs=top_lp,
    )


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> list[PositionLogprobs]:
    """Raw-logit logprob and rank of given tokens (one per row of logits [N, V]) with top-n alternatives.

    Used for prompt logprobs, where the "chosen" token is the prompt's next token.
    """
    parts = _compute_logprobs(logits, num_top)
    tensors = _finish_logprobs(parts, token_ids.to(logits.device)).cpu()  # one copy to the host
    return [tensors.row(i, num_top) for i in range(logits.shape[0])]
