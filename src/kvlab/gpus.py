"""The GPUs kvlab knows by name: each card's datasheet memory, bandwidth and dense FLOP/s.

Stage 0 sizes a server by a card's memory; stage 7's simulated clock (`kvlab.serving.cost_model`)
also needs its peak memory bandwidth and dense bf16/fp16 tensor-core FLOP/s (the roofline's two
ceilings). All are vendor datasheet figures for the SXM / OAM parts: NOMINAL memory read as GiB
(a card reports less to torch.cuda: the driver, ECC and CUDA context keep some, and a datasheet's
"GB" is not always 2**30 bytes), bandwidth in TB/s and TFLOP/s without sparsity. A card with no
bandwidth or FLOP/s here can be sized but not simulated.
"""

from __future__ import annotations

import dataclasses

from .errors import SizingError

__all__ = ["Card", "CARDS", "find_card", "get_card", "GPU_MEMORY_SOURCE"]

GPU_MEMORY_SOURCE = "nominal, vendor datasheet"


@dataclasses.dataclass(frozen=True)
class Card:
    """One GPU's datasheet figures (bandwidth and FLOP/s None where kvlab has none)."""

    name: str
    memory_gib: int                            # nominal HBM / GDDR capacity
    bandwidth_bytes_per_s: float | None = None  # peak memory bandwidth
    flops_per_s: float | None = None            # peak dense bf16/fp16 tensor-core FLOP/s

    @property
    def memory_bytes(self) -> int:
        return self.memory_gib * 2**30

    @property
    def has_roofline(self) -> bool:
        """Both figures a simulated step's time needs are known."""
        return self.bandwidth_bytes_per_s is not None and self.flops_per_s is not None


def _card(name: str, memory_gib: int, bandwidth_tb_s: float | None = None,
          dense_tflops: float | None = None) -> Card:
    return Card(name, memory_gib, None if bandwidth_tb_s is None else bandwidth_tb_s * 1e12,
                None if dense_tflops is None else dense_tflops * 1e12)


# Each card's vendor datasheet (NVIDIA's, AMD's): memory in GiB; bandwidth in TB/s and dense
# bf16 TFLOP/s where kvlab times steps on the card.
CARDS: dict[str, Card] = {card.name: card for card in [
    _card("T4", 16), _card("L4", 24, 0.3, 121), _card("A10G", 24), _card("RTX-4090", 24),
    _card("L40S", 48),
    _card("A100-40GB", 40, 1.555, 312), _card("A100-80GB", 80, 2.039, 312),  # SXM
    _card("H100-80GB", 80, 3.35, 989), _card("H200", 141, 4.8, 989),          # SXM
    _card("B200", 180), _card("MI300X", 192, 5.3, 1307),
]}


def find_card(name: str) -> Card | None:
    """The card of that name (case-insensitive), or None."""
    return next((card for card in CARDS.values() if card.name.lower() == name.lower()), None)


def get_card(name: str) -> Card:
    """The card of that name with roofline figures (what the simulated clock needs); SizingError
    naming the cards that have them."""
    card = find_card(name)
    if card is None or not card.has_roofline:
        with_figures = [card.name for card in CARDS.values() if card.has_roofline]
        raise SizingError(f"no roofline figures for GPU {name!r}; known: "
                          f"{', '.join(with_figures)}")
    return card
