"""The README shows real output: its `kvlab report` block must be what the command prints now; and
CI runs the README's commands as the README writes them."""

import re
import subprocess
from pathlib import Path

from kvlab.cli import main

ROOT = Path(__file__).resolve().parents[1]
MARKER = "<!-- .ci/run runs the next block as written -->"


def test_ci_runs_the_readme_commands_as_written():
    """.ci/run reads its commands from the README (the block after each marker), so the two cannot
    drift: the first two code blocks of "The two commands" that install kvlab, in order, the
    last of them running the whole suite after fetching what the notebooks need."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## The two commands\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"([^\n]*)\n```bash\n(.*?)\n```", section, re.S)  # (line above, code)
    marked = [code for before, code in blocks if before == MARKER]
    installs = [code for _, code in blocks if code.startswith("pip install -e ")]
    assert marked == installs and len(marked) == 2, blocks
    printed = subprocess.run(["bash", str(ROOT / ".ci" / "run"), "--print"], capture_output=True,
                             text=True, check=True).stdout
    assert printed == "".join(f"{code}\n" for code in marked)
    assert marked[-1].startswith('pip install -e ".[test]" && ')
    assert marked[-1].endswith(" && python -m pytest")  # the whole suite, as pyproject says
    assert "kvlab fetch smollm2-135m" in marked[-1]
    # .ci/run has no copy of its own: no pytest or kvlab command outside the README's.
    script = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
              if not line.lstrip().startswith("#")]
    assert not [line for line in script if re.search(r"\bpytest\b|\bkvlab (fetch|report)", line)]


def test_readme_says_what_a_fresh_machine_needs_before_the_commands():
    """A venv, the CPU torch before kvlab, the disk the venv takes, the suite's time, chromium."""
    section = (ROOT / "README.md").read_text().split("## The two commands\n", 1)[1]
    section = " ".join(section.split("\n## ", 1)[0].split())
    steps = ["python3 -m venv .venv && . .venv/bin/activate",
             "pip install torch --index-url https://download.pytorch.org/whl/cpu",
             "pip install -e . && kvlab report"]
    assert all(step in section for step in steps) and \
        sorted(steps, key=section.index) == steps, "venv, then the CPU torch, then the course"
    assert re.search(r"venv needs about [\d.]+ GiB of disk", section)
    assert re.search(r"suite takes about \d+ minutes .*passed, \d+ skipped in [\d,]+ s", section)
    assert "Debian's `chromium`" in section and "skips" in section


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
    assert f"prompt p99 is {fit.prompt_p99:,.0f} tokens against {trace.prompt_p99:,.0f}" in readme
    assert f"output p99, {fit.output_p99:,.0f}, is above the trace's {trace.output_p99:,.0f}" in readme


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
