"""The calibrated clock: its data (published figures with sources), its re-timing of recorded
steps (exact at the recording's clock), its fit (recovers known factors), the stored fit in step
with the code, and `kvlab serve` naming the clock and its error band under every table."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from cli_run import run
from kvlab.config import load_config
from kvlab.serving import CostModel, Request, SimulatedExecutor, get_card, serve
from kvlab.calibration import clock as cal
from kvlab.tools.calibration import fit_clock as fit

CLOSED = [m for m in fit.load_measurements() if m.workload["kind"] == "batch"]


def test_every_measurement_names_its_source_configuration_figure_and_units():
    measurements = fit.load_measurements()
    assert len(measurements) == 22 and len({m.id for m in measurements}) == 22
    for m in measurements:
        assert m.source and m.configuration and m.published > 0
        assert m.units in fit.UNITS and m.metric in fit.METRICS
        get_card(m.card)  # a card the cost model knows
    first = measurements[0]
    assert (first.published, first.units, first.value) == (833, "ms", pytest.approx(0.833))


def test_calibrated_step_time_by_hand():
    config = load_config("llama-3.1-70b")
    cost = CostModel(config, get_card("H100-80GB"), tp=4, compute_efficiency=0.5,
                     bandwidth_efficiency=0.8, step_overhead_s=0.002, allreduce_latency_s=1e-5,
                     link_bytes_per_s=450e9, clock="calibrated")
    roofline = CostModel(config, get_card("H100-80GB"), tp=4)
    moved, _ = roofline.step_work(100, 100_000, 100 * 1001, 100)
    # 160 all-reduces (2 a layer), each 1e-5 s + 100 tokens x 8,192 x 2 B x 2 x 3/4 over 450 GB/s
    allreduce = 160 * (1e-5 + 100 * 8192 * 2 * 1.5 / 450e9)
    assert cost.step_time(100, 100_000, 100 * 1001, 100) == pytest.approx(
        moved / (0.8 * 3.35e12) + 0.002 + allreduce)
    assert cal.describe_clock(cost) == (
        "clock: calibrated: 50.0 % of peak FLOP/s, 80.0 % of peak bandwidth, +2.00 ms a step, "
        "+10.0 \N{MICRO SIGN}s for each of 160 all-reduces a step")
    single = CostModel(config, get_card("H100-80GB"), tp=1, allreduce_latency_s=1.0)
    alone = CostModel(config, get_card("H100-80GB"))
    assert single.step_time(1, 0, 1, 1) == alone.step_time(1, 0, 1, 1)
    with pytest.raises(ValueError, match="compute_efficiency must be in"):
        CostModel(config, get_card("H100-80GB"), compute_efficiency=1.5)


def small_open_measurement(metric):
    return dataclasses.replace(CLOSED[0], id="test", model="llama-3.1-8b", card="H100-80GB",
                               tp=1, workload={"kind": "sharegpt", "num_prompts": 40, "rate": 8},
                               metric=metric)


@pytest.mark.parametrize("metric", ["tpot_p50_s", "throughput_tok_s", "e2e_s"])
def test_retiming_at_the_recordings_own_clock_gives_the_replays_figures(metric):
    # An open workload (Poisson arrivals, idle waits between them) replayed at the stored fit.
    m = small_open_measurement(metric)
    factors = cal.stored_factors()
    config = load_config(m.model)
    requests, scheduler, budget, max_model_len = fit._workload(m, config)
    cost = cal.clock_cost_model(config, m.card, m.tp, factors=factors)
    result = serve(requests, fit._manager(budget, cost.kv_bytes_per_token, max_model_len),
                   SimulatedExecutor(cost), scheduler)
    expected = {"tpot_p50_s": result.tpot_p50_s, "throughput_tok_s": result.output_tokens_per_s,
                "e2e_s": result.duration_s}[metric]
    assert fit.predict(m, factors) == pytest.approx(expected, rel=1e-9)


def test_a_closed_batch_retimed_at_another_clock_equals_its_replay_there():
    # Everything arrives at t = 0: no decision depends on the clock, so re-timing is exact.
    factors = cal.stored_factors()
    for m in CLOSED[:4] + CLOSED[6:8]:
        assert fit._record(m, cal.ROOFLINE).retime(factors) == pytest.approx(
            fit.predict(m, factors), rel=1e-9)


def test_a_bandwidth_at_the_fits_bound_is_said_where_the_clock_is_printed():
    # The stored fit runs the bandwidth efficiency to its bound (docs/simulation_clock.md): the
    # clock's line and the note under every table say so; a share below it is printed plainly.
    assert cal.stored_factors().shared_bandwidth_efficiency == pytest.approx(1.0, abs=5e-4)
    assert cal.BOUND_NOTE in cal.clock_note("calibrated")
    assert cal.BOUND_NOTE not in cal.clock_note("roofline")
    config = load_config("llama-3.1-70b")
    line = cal.describe_clock(cal.clock_cost_model(config, "H100-80GB", 2))
    assert "100.0 % of peak bandwidth (the fit's bound), +4.34 ms a step" in line
    below = CostModel(config, get_card("H100-80GB"), bandwidth_efficiency=0.999,
                      clock="calibrated")
    assert "99.9 % of peak bandwidth, " in cal.describe_clock(below)
    assert "fit's bound" not in cal.describe_clock(CostModel(config, get_card("H100-80GB")))


def test_fit_with_the_bandwidth_held_recovers_the_other_factors():
    # `fit_clock --hold-bandwidth`: what the fit puts elsewhere when the read is held slower.
    truth = cal.Factors({}, {}, 0.6, 0.7, 0.003, 4e-5)
    made = [dataclasses.replace(m, published=fit.predict(m, truth) / fit.UNITS[m.units])
            for m in CLOSED]
    fitted = fit.fit(made, rounds=1, held_bandwidth=0.7)
    assert set(fitted.bandwidth_efficiency.values()) == {0.7}
    assert fitted.shared_bandwidth_efficiency == 0.7
    assert fitted.shared_compute_efficiency == pytest.approx(0.6, rel=1e-3)
    assert fitted.step_overhead_s == pytest.approx(0.003, rel=1e-3)
    with pytest.raises(ValueError, match="held_bandwidth must be a share of peak"):
        fit.fit(made, held_bandwidth=1.2)


def test_fit_recovers_known_factors_from_figures_it_made():
    truth = cal.Factors({}, {}, 0.6, 0.7, 0.003, 4e-5)
    cards = sorted({m.card for m in CLOSED})
    truth = dataclasses.replace(truth, compute_efficiency=dict.fromkeys(cards, 0.6),
                                bandwidth_efficiency=dict.fromkeys(cards, 0.7))
    made = [dataclasses.replace(m, published=fit.predict(m, truth) / fit.UNITS[m.units])
            for m in CLOSED]
    fitted = fit.fit(made, rounds=1)
    assert fitted.shared_compute_efficiency == pytest.approx(0.6, rel=1e-3)
    assert fitted.shared_bandwidth_efficiency == pytest.approx(0.7, rel=1e-3)
    assert fitted.step_overhead_s == pytest.approx(0.003, rel=1e-3)
    assert fitted.allreduce_latency_s == pytest.approx(4e-5, rel=1e-2)


def test_the_stored_fit_is_the_codes():
    # The closed measurements replay in a second; their stored errors must be what the code says.
    stored = cal.calibration_data()["fitted"]
    for r in fit.residuals(measurements=CLOSED):
        assert r.error == pytest.approx(stored["errors"][r.measurement.id], abs=1e-4)
        assert r.roofline / r.measurement.value - 1 == pytest.approx(
            stored["roofline_errors"][r.measurement.id], abs=1e-4)
    factors = cal.stored_factors()
    # shares of the datasheet's peaks; the bandwidth's may reach 1 (the published measurements
    # do not separate it from the per-step overhead: docs/simulation_clock.md)
    assert 0 < factors.shared_compute_efficiency < 1
    assert 0 < factors.shared_bandwidth_efficiency <= 1
    assert factors.efficiencies("L4") == (factors.shared_compute_efficiency,
                                          factors.shared_bandwidth_efficiency)  # not measured


def test_error_band_reads_as_percent_with_true_minus_signs():
    assert cal.error_band([-0.181, 0.05, 0.224]) == \
        "\N{MINUS SIGN}18 % \N{HORIZONTAL ELLIPSIS} +22 % over 3 published measurements"
    stored = list(cal.calibration_data()["fitted"]["errors"].values())
    bound = f"; {cal.BOUND_NOTE}" if cal.stored_factors().shared_bandwidth_efficiency >= 0.9995 \
        else ""
    assert cal.clock_note("calibrated") == f"clock: calibrated (fit residuals " \
                                           f"{cal.error_band(stored)}{bound})"
    with pytest.raises(ValueError, match="unknown clock 'wall'"):
        cal.clock_cost_model(load_config("llama-3.1-8b"), "H100-80GB", clock="wall")


SIMULATE = ("serve", "--trace", "azure-conv", "--num-requests", "30", "--simulate", "--model",
            "llama-3.1-8b", "--gpu", "H100-80GB", "--strategy", "paged")


@pytest.mark.parametrize("clock", [None, "roofline", "calibrated"])
def test_cli_serve_says_which_clock_and_its_error_band_under_the_table(capsys, clock):
    flags = () if clock is None else ("--clock", clock)
    code, out, err = run(capsys, *SIMULATE, *flags)
    assert code == 0, err
    table, note = out.split("\n\n")[1].splitlines()[:3], out.split("\n\n")[1].splitlines()[3]
    assert "states/reserved" in table[0] and "reserved/pool mean" in table[0]
    assert note == cal.clock_note(clock or "calibrated")
    assert note.startswith(f"clock: {clock or 'calibrated'}") and "published measurements" in note


def test_cli_serve_calibrated_clock_is_slower_than_the_roofline(capsys):
    rows = {}
    for clock in ("roofline", "calibrated"):
        code, out, _ = run(capsys, *SIMULATE, "--clock", clock, "--json")
        rows[clock] = json.loads(out)
        assert rows[clock]["clock_name"] == clock
    assert rows["calibrated"]["rows"][0]["tpot_p50_s"] > 1.3 * rows["roofline"]["rows"][0][
        "tpot_p50_s"]
    assert not math.isnan(rows["calibrated"]["rows"][0]["ttft_p50_s"])


def test_power_of_two_reservation():
    from kvlab.serving.reservation import power_of_two

    # The paper's example: 25 output tokens reserve 32; the prompt is reserved as it is.
    assert [power_of_two(Request(0, 0.0, p, o)) for p, o in ((1, 1), (3, 1), (100, 25), (600, 424),
                                                             (600, 513))] == [2, 4, 132, 1112, 1624]
