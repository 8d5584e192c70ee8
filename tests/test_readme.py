"""The README shows real output: its `kvlab report` block must be what the command prints now."""

from pathlib import Path

from kvlab.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_readme_report_block_is_the_current_output(capsys):
    assert main(["report"]) == 0
    printed = capsys.readouterr().out.rstrip()
    readme = (ROOT / "README.md").read_text()
    block = readme.split("$ kvlab report\n", 1)[1].split("\n```", 1)[0]
    assert block == printed, "README's kvlab report block is stale: paste the command's output"


def test_readme_trace_figures_are_computed():
    """The README's sentences on the real trace and the synthetic fit quote what the code computes."""
    from kvlab.traces import azure_trace
    from kvlab.workload import compare_to_trace

    readme = " ".join((ROOT / "README.md").read_text().split())
    trace, fit = compare_to_trace(azure_trace("conv"))
    real_share = f"{100 * trace.share_longer_than[4096]:.1f} %"
    fit_share = f"{100 * fit.share_longer_than[4096]:.1f} %"
    assert f"({trace.num_requests:,} requests;" in readme
    assert f"{real_share} of its requests are longer than 4,096 tokens" in readme
    assert (f"{fit_share} of the synthetic requests are longer than 4,096 tokens against "
            f"{real_share} of the real ones") in readme
    assert f"prompt p99 is {fit.prompt_p99:,} tokens against {trace.prompt_p99:,}" in readme
    assert f"output p99, {fit.output_p99:,}, is above the trace's {trace.output_p99:,}" in readme


def test_readme_copy_on_write_example_prompt_length():
    """The README's copy-on-write example says how many tokens its prompt has: count them."""
    import re

    from kvlab.checkpoint import load_tokenizer

    readme = (ROOT / "README.md").read_text()
    example = readme.split("--n 4 --temperature 0.8", 1)[1]
    prompt = re.search(r'--prompt "([^"]+)"', example).group(1)
    tokens = len(load_tokenizer("tiny").encode(prompt).ids)
    assert f"one {tokens}-token prompt" in example
    # Several whole blocks of 4 tokens are shared, so sharing saves memory at the peak.
    assert tokens >= 3 * 4
