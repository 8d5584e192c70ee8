"""kvlab.traces: the shipped Azure LLM inference trace 2023, and its CSV reader."""

from __future__ import annotations

import pytest

from kvlab.input_files import InputFileError
from kvlab.traces import (AZURE_TRACES, TraceFormatError, azure_trace, azure_trace_path,
                          load_azure_trace)
from kvlab.workload import Request


# ---- the shipped trace -----------------------------------------------------------------------

def test_shipped_traces_have_the_published_sizes():
    """Row counts and statistics as published with the trace (Splitwise, ISCA 2024; the data's
    README): conv 19,366 requests, context mean 1,155 / median 1,020; code 8,819 requests."""
    import statistics

    conv = azure_trace("conv")
    assert len(conv) == 19_366
    assert conv[0] == Request(374, 44, 0.0)
    assert round(statistics.fmean(r.prompt_len for r in conv)) == 1155
    assert statistics.median(r.prompt_len for r in conv) == 1020
    assert round(statistics.fmean(r.output_len for r in conv)) == 211
    assert max(r.output_len for r in conv) == 1000
    code = azure_trace("code")
    assert len(code) == 8_819
    assert round(statistics.fmean(r.prompt_len for r in code)) == 2048
    # Arrivals span about an hour, in order.
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(conv, conv[1:]))
    assert 3000 < conv[-1].arrival_s < 3700


def test_shipped_trace_files_carry_their_attribution():
    folder = azure_trace_path("conv").parent
    for name in AZURE_TRACES.values():
        assert (folder / name).is_file()
    readme = (folder / "README.md").read_text()
    for fact in ("CC BY 4.0", "Creative Commons Attribution 4.0", "Splitwise", "ISCA 2024",
                 "AzurePublicDataset"):
        assert fact in readme, fact
    assert "Splitwise" in (folder / "NOTICE").read_text()
    with pytest.raises(ValueError, match="'chat'.*conv, code"):
        azure_trace_path("chat")


def test_limit_reads_the_first_rows():
    assert azure_trace("code", limit=3) == azure_trace("code")[:3]


# ---- Azure trace CSV -------------------------------------------------------------------------

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def write_trace(tmp_path, body: str, header: str = HEADER):
    path = tmp_path / "trace.csv"
    path.write_text(header + body)
    return path


def test_load_trace_in_file_order_with_arrivals(tmp_path):
    path = write_trace(tmp_path, "2023-11-16 18:15:46.6805900,374,44\n"
                                 "2023-11-16 18:15:50.9951690,396,109\n"
                                 "2023-11-16 18:16:46.6805900,879,0\n")
    requests = load_azure_trace(path)
    assert [(r.prompt_len, r.output_len) for r in requests] == [(374, 44), (396, 109), (879, 0)]
    assert requests[0].arrival_s == 0.0
    assert requests[1].arrival_s == pytest.approx(50.995169 - 46.68059, abs=1e-6)
    assert requests[2].arrival_s == pytest.approx(60.0, abs=1e-6)
    assert load_azure_trace(str(path), limit=2) == requests[:2]


def test_limit_is_never_exceeded(tmp_path):
    path = write_trace(tmp_path, "t,5,6\nt,7,8\nt,9,10\n")
    assert len(load_azure_trace(path, limit=1)) == 1
    assert len(load_azure_trace(path, limit=10)) == 3
    try:
        none = load_azure_trace(path, limit=0)
    except ValueError:
        return  # refusing limit=0 is as good as reading nothing
    assert none == []


def test_unparseable_timestamps_give_zero_arrival(tmp_path):
    requests = load_azure_trace(write_trace(tmp_path, "yesterday,5,6\n,7,8\n"))
    assert [(r.prompt_len, r.output_len, r.arrival_s) for r in requests] == [(5, 6, 0.0),
                                                                             (7, 8, 0.0)]


def test_columns_in_any_order_and_spaces(tmp_path):
    path = write_trace(tmp_path, "12, 3,t\n", header="ContextTokens,GeneratedTokens,TIMESTAMP\n")
    assert load_azure_trace(path) == [Request(12, 3)]


@pytest.mark.parametrize("row, line, fragments", [
    ("t,abc,5", 3, ["ContextTokens", "'abc'"]),
    ("t,12,4.5", 3, ["GeneratedTokens", "'4.5'"]),
    ("t,-7,5", 3, ["ContextTokens", "-7"]),
    ("t,0,5", 3, ["ContextTokens", "0", ">= 1"]),
    ("t,10,-1", 3, ["GeneratedTokens", "-1"]),
    ("t,10", 3, ["2 of the header's 3 fields", "TIMESTAMP,ContextTokens,GeneratedTokens"]),
    ("t,,5", 3, ["ContextTokens", "''"]),
])
def test_malformed_rows_name_line_and_value(tmp_path, row, line, fragments):
    path = write_trace(tmp_path, f"t,5,6\n{row}\nt,7,8\n")
    with pytest.raises(TraceFormatError) as info:
        load_azure_trace(path)
    message = str(info.value)
    assert f"trace.csv:{line}" in message
    for fragment in fragments:
        assert fragment in message, fragment
    assert isinstance(info.value, ValueError) and isinstance(info.value, InputFileError)


def test_header_missing_a_column(tmp_path):
    path = write_trace(tmp_path, "t,5\n", header="TIMESTAMP,ContextTokens\n")
    with pytest.raises(TraceFormatError, match="GeneratedTokens"):
        load_azure_trace(path)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_azure_trace(tmp_path / "nope.csv")
