"""Simulation mode's clock: how long one step takes on a named card, from a roofline.

A forward pass must at least read every weight once and every cached K/V its requests attend
over, at the card's memory bandwidth, and do its arithmetic at the card's peak FLOP rate; it takes
the longer of the two (the roofline model, Williams et al., CACM 2009). Per GPU, under tensor
parallelism each of `tp` GPUs holding 1/tp of the weights and KV heads:

    bytes = weights + KV bytes per token x (tokens attended over + tokens written)
    flops = 2 x decoder-layer parameters x tokens computed + 2 x LM-head parameters x rows sampled
            + 4 x layers x query heads x head_dim x (query, key) pairs attended
    step  = max(bytes / (bandwidth_efficiency x bandwidth), flops / (compute_efficiency x FLOP/s))
            + step_overhead_s + 2 x layers x (allreduce_latency_s + ring bytes / link bandwidth)

The embedding is a lookup, and the LM head runs only on the row of each request that samples this
step (vLLM's `logits_indices`): a prefill chunk that does not finish its prompt samples nothing.
That matters for small models: SmolLM2-135M's tied embedding is 21 % of its parameters
(Llama-3.1-8B's untied pair 13 %, 70B's 3 %). Decode steps are memory-bound; long prefills are
compute-bound. The last term is paid only for tp > 1: two all-reduces per layer (after attention
and after the MLP) of tokens x hidden_size activations, each GPU sending 2 (tp - 1) / tp of them
in a ring (Shoeybi et al., Megatron-LM, 2019).

With the defaults (efficiencies 1, no overheads) this is the `roofline` clock, a lower bound: real
kernels reach 60-90 % of peak, and sampling, scheduling and Python cost time. The `calibrated`
clock's derating factors are fitted to published measurements of real engines
(`kvlab.calibration.clock`).
"""

from __future__ import annotations

from ..config import LlamaConfig
from ..gpus import Card
from ..sizing import dtype_bytes, kv_bytes_per_token, weights_bytes

__all__ = ["CostModel"]


class CostModel:
    """Step time of one model on `tp` cards of one kind (a `kvlab.gpus.Card` with roofline
    figures); dtype names the weights' and KV's ('bf16', 'fp16', 'fp8', 'fp32'). Efficiencies are
    shares of peak in (0, 1]; times are seconds; link_bytes_per_s is one-way GPU-to-GPU bandwidth
    (None: the all-reduce's bytes are not counted); clock names the clock in tables.
    SizingError: an impossible tp or unknown dtype. ValueError: a card without roofline figures,
    an efficiency outside (0, 1] or a negative time."""

    def __init__(self, config: LlamaConfig, card: Card, tp: int = 1, dtype: str = "bf16",
                 step_overhead_s: float = 0.0, compute_efficiency: float = 1.0,
                 bandwidth_efficiency: float = 1.0, allreduce_latency_s: float = 0.0,
                 link_bytes_per_s: float | None = None, clock: str = "roofline"):
        for name, value in (("compute_efficiency", compute_efficiency),
                            ("bandwidth_efficiency", bandwidth_efficiency)):
            if not 0 < value <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {value}")
        if not card.has_roofline:
            raise ValueError(f"{card.name}: no bandwidth or FLOP/s in kvlab.gpus to time a step")
        if step_overhead_s < 0 or allreduce_latency_s < 0:
            raise ValueError(f"step_overhead_s ({step_overhead_s}) and allreduce_latency_s "
                             f"({allreduce_latency_s}) must be >= 0")
        self.config, self.card, self.tp, self.dtype = config, card, tp, dtype
        self.step_overhead_s, self.clock = step_overhead_s, clock
        self.bandwidth = card.bandwidth_bytes_per_s * bandwidth_efficiency
        self.flops = card.flops_per_s * compute_efficiency
        self.allreduce_latency_s = allreduce_latency_s
        self.allreduce_s = 0.0 if tp == 1 else 2 * config.num_hidden_layers * allreduce_latency_s
        self.allreduce_s_per_token = 0.0 if tp == 1 or not link_bytes_per_s else (
            2 * config.num_hidden_layers * 2 * (tp - 1) / tp * config.hidden_size
            * dtype_bytes(dtype) / link_bytes_per_s)
        self.weights_bytes = weights_bytes(config, dtype, tp)
        params_per_gpu = self.weights_bytes // dtype_bytes(dtype)
        # The embedding (the LM head's matrix when tied) is a lookup: no FLOPs.
        self.lm_head_params = config.vocab_size * config.hidden_size // tp
        embeddings = self.lm_head_params * (1 if config.tie_word_embeddings else 2)
        self.layer_params = params_per_gpu - embeddings
        self.kv_bytes_per_token = kv_bytes_per_token(config, dtype, tp)
        # FLOPs per (query token, key token) pair: QK^T and PV, 2 each per multiply-add.
        self.flops_per_pair = (4 * config.num_hidden_layers * (config.num_attention_heads // tp)
                               * config.head_dim)

    def __repr__(self) -> str:  # short enough to name the clock in a failed check's message
        return (f"CostModel({self.clock}: {getattr(self.config, 'name', 'model')} on {self.tp} x "
                f"{self.card.name}, {self.dtype})")

    def step_time(self, num_batched_tokens: int, kv_tokens_read: int, attention_pairs: int,
                  num_sampled: int) -> float:
        """Seconds for one forward pass computing num_batched_tokens (prefill + decode, each
        written to the cache), reading kv_tokens_read cached tokens, attending attention_pairs
        (query, key) pairs, both summed over requests, and sampling num_sampled rows."""
        if num_batched_tokens == 0:
            return 0.0
        moved, flops = self.step_work(num_batched_tokens, kv_tokens_read, attention_pairs,
                                      num_sampled)
        return self.time_of_work(moved, flops, num_batched_tokens)

    def time_of_work(self, moved, flops, num_batched_tokens, maximum=max):
        """Seconds of a pass moving `moved` bytes and doing `flops` (numbers, or numpy arrays of
        steps with maximum=np.maximum: how `kvlab.tools.calibration` re-times recorded steps)."""
        return (maximum(moved / self.bandwidth, flops / self.flops) + self.step_overhead_s
                + self.allreduce_s + self.allreduce_s_per_token * num_batched_tokens)

    def step_work(self, num_batched_tokens: int, kv_tokens_read: int, attention_pairs: int,
                  num_sampled: int) -> tuple[int, int]:
        """(bytes moved, FLOPs) per GPU of one forward pass (arguments as `step_time`)."""
        moved = (self.weights_bytes
                 + (kv_tokens_read + num_batched_tokens) * self.kv_bytes_per_token)
        flops = (2 * self.layer_params * num_batched_tokens + 2 * self.lm_head_params * num_sampled
                 + self.flops_per_pair * attention_pairs)
        return moved, flops

    @staticmethod
    def step_sizes(scheduled) -> tuple[int, int, int, int]:
        """(tokens computed, cached tokens read, attention pairs, rows sampled) of a
        `SchedulerOutput.scheduled` list, before `update` (progress unchanged).

        A request computing n new tokens after c cached ones reads c keys besides its own and
        attends n x c + n (n + 1) / 2 (query, key) pairs (causal); it samples when the n reach its
        last token.
        """
        tokens = kv = pairs = sampled = 0
        for request, num_new in scheduled:
            computed = request.num_computed_tokens
            tokens += num_new
            kv += computed
            pairs += num_new * computed + num_new * (num_new + 1) // 2
            sampled += computed + num_new == request.num_tokens
        return tokens, kv, pairs, sampled

    def step_time_of(self, scheduled) -> float:
        """`step_time` of a `SchedulerOutput.scheduled` list (sizes from `step_sizes`)."""
        return self.step_time(*self.step_sizes(scheduled))
