"""kvlab.plots.draw_block_tables draws what the cache holds: entries, owners, positions, ref counts."""

from types import SimpleNamespace

import matplotlib.pyplot as plt
import pytest
from matplotlib.patches import Rectangle

from kvlab.config import LlamaConfig
from kvlab.paged import PagedKVCache
from kvlab.plots import draw_block_tables

TOY = LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                  num_attention_heads=1, num_key_value_heads=1, head_dim=1, name="toy")


def texts(fig):
    return [text.get_text() for text in fig.axes[0].texts]


def test_block_tables_and_pool_are_drawn_from_the_cache():
    pool = PagedKVCache(TOY, num_blocks=6, block_size=4)
    a, a2, c = (SimpleNamespace(request_id=name) for name in ("A", "A2", "C"))
    pool.manager.allocate_slots(a, 6)    # blocks 0, 1 (1 holds positions 4, 5)
    pool.manager.fork(a, a2)             # shares both: ref count 2
    pool.manager.allocate_slots(c, 3)    # block 2
    open_before = plt.get_fignums()
    fig = draw_block_tables(pool, "toy")
    labels = texts(fig)
    assert [label for label in labels if "→" in label] == ["0→2", "0→0", "1→1", "0→0", "1→1"]
    assert [label for label in labels if label.startswith("seq ")] == ["seq C", "seq A2", "seq A"]
    assert "block 0\nref count 2" in labels and "block 1\nref count 2" in labels
    assert "block 2" in labels and "block 5" in labels
    positions = [label for label in labels if label.isdigit()]
    assert positions == ["0", "1", "2", "3", "4", "5", "0", "1", "2"]  # blocks 0, 1, 2
    hatched = [patch for patch in fig.axes[0].patches
               if isinstance(patch, Rectangle) and patch.get_hatch() == "//"]
    assert len(hatched) == 6  # A's six tokens, shared with A2
    assert fig.axes[0].get_title() == "toy"
    assert plt.get_fignums() == [*open_before, fig.number]  # a pyplot figure: shown at cell end
    plt.close(fig)


def test_an_empty_cache_is_refused():
    with pytest.raises(ValueError, match="holds no sequence"):
        draw_block_tables(PagedKVCache(TOY, num_blocks=2, block_size=4))


def test_timeline_records_each_step_and_draws_one_cell_per_request_and_step():
    from kvlab.plots import PHASES, draw_timeline, step_phases
    from kvlab.serving import Request, Scheduler, SchedulerConfig, simulated_manager

    kv = simulated_manager("paged", 4 * 4 * 10, 10, max_model_len=16, block_size=4)  # 4 blocks
    scheduler = Scheduler(kv, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64))
    for request in (Request(i, 0.0, 4, 6) for i in range(4)):
        scheduler.add_request(request)
    steps = []
    while scheduler.has_unfinished():
        output = scheduler.schedule()
        phases = step_phases(output, scheduler.waiting)
        for request in scheduler.update(output, None, float(len(steps))):
            phases[request.request_id] = "finished"  # its last decode step
        steps.append(phases)
    # Step 0 prefills all four (one block each, the pool full); step 1 needs 4 new blocks, so the
    # two newest are preempted (recompute) and wait while the oldest two decode.
    assert steps[0] == {0: "prefill", 1: "prefill", 2: "prefill", 3: "prefill"}
    assert steps[1] == {0: "decode", 1: "decode", 2: "preempted", 3: "preempted"}
    seen = {phase for step in steps for phase in step.values()}
    assert {"prefill", "decode", "preempted", "waiting", "finished"} <= seen
    fig = draw_timeline(steps, "toy")
    bars = fig.axes[0].patches
    assert len(bars) == sum(len(step) for step in steps)
    colours = {tuple(round(c, 3) for c in bar.get_facecolor()[:3]) for bar in bars}
    assert len(colours) == len(seen)  # one colour per phase drawn
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == [
        f"request {i}" for i in range(4)]
    plt.close(fig)
    with pytest.raises(ValueError, match="phase 'running'"):
        draw_timeline([{0: "running"}])
    assert set(PHASES) == {"waiting", "prefill", "decode", "preempted", "finished"}
