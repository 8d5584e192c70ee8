"""How much reserved KV memory holds token states: the vLLM paper's figure 2 on one scheduler.

Kwon et al. (SOSP 2023, figure 2) measured the share of KV memory holding token states in Orca's
reservations, which must be fixed at admission: the maximum length ("Orca (Max)", 20.4 %), the
output rounded up to a power of two ("Orca (Pow2)", 26.8 %), its exact final length
known in advance ("Orca (Oracle)", 38.2 %), against vLLM's blocks taken as the request grows
(96.3 %). Their workload was OPT-13B on ShareGPT and Alpaca; here it is any trace (the course uses
Azure's conversation trace, whose outputs are short: a reservation sized for the prompt plus the
output wastes less than on ShareGPT, whose outputs are long).

The four strategies here differ only in what they reserve, all on the same scheduler and clock:

* max length: `ContiguousManager`, one max_model_len slab per request (stage 2);
* power of two: `FirstFitSlabManager` reserving the prompt + the output rounded up to a power of
  two (`reservation.power_of_two`; at most a max_model_len slab);
* oracle: `FirstFitSlabManager` reserving exactly prompt + output;
* paged: `KVCacheManager`, a block of `block_size` tokens at a time (stage 4).

The figure is `ServeResult.kv_states_share`: slot-seconds holding a computed K/V over slot-seconds
reserved.
"""

from __future__ import annotations

from typing import Sequence

from kvlab.serving.cost_model import CostModel
from kvlab.serving.engine_core import SimulatedExecutor, serve
from kvlab.serving.strategies import simulated_manager
from kvlab.serving.metrics import ServeResult
from kvlab.serving.request import Request
from kvlab.serving.reservation import FirstFitSlabManager, power_of_two
from kvlab.serving.scheduler import SchedulerConfig

__all__ = ["RESERVATIONS", "token_state_shares"]

RESERVATIONS = ("max length", "power of two", "oracle", "paged")


def _manager(name: str, kv_budget_bytes: int, bytes_per_token: int, max_model_len: int,
             block_size: int):
    """The KV manager of one reservation (the one place this module builds strategies)."""
    if name == "max length":
        return simulated_manager("contiguous", kv_budget_bytes, bytes_per_token, max_model_len)
    if name == "paged":
        return simulated_manager("paged", kv_budget_bytes, bytes_per_token, max_model_len,
                                 block_size)
    capacity = kv_budget_bytes // bytes_per_token
    if name == "power of two":
        manager = FirstFitSlabManager(capacity, max_model_len, power_of_two)
    elif name == "oracle":
        manager = FirstFitSlabManager(capacity, max_model_len)
    else:
        raise ValueError(f"unknown reservation {name!r}; choose from {', '.join(RESERVATIONS)}")
    manager.name = name
    return manager


def token_state_shares(requests: Sequence[Request], cost: CostModel, kv_budget_bytes: int,
                       max_model_len: int, config: SchedulerConfig = SchedulerConfig(),
                       block_size: int = 16,
                       reservations: Sequence[str] = RESERVATIONS) -> dict[str, ServeResult]:
    """Replay `requests` with each reservation on `cost`'s clock; `kv_states_share` of each
    result is the figure-2 share.

    Args:
        requests: the workload (requests longer than max_model_len are rejected, as everywhere).
        cost: the clock (its config, tp and dtype set the KV bytes per token).
        kv_budget_bytes: KV memory per GPU.
        max_model_len: longest request; the max-length slab's size.
        config: step budgets; block_size: the paged strategy's block.
        reservations: which of `RESERVATIONS`, in order.

    Raises:
        ValueError: an unknown reservation or a budget that holds no max_model_len request.
    """
    per_token = cost.kv_bytes_per_token
    return {name: serve(requests, _manager(name, kv_budget_bytes, per_token, max_model_len,
                                           block_size),
                        SimulatedExecutor(cost), config, per_token) for name in reservations}
