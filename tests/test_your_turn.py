"""kvlab.your_turn: the fallback when unwritten, the failure on a wrong answer that runs, the pass."""

import pytest
import torch

from kvlab.your_turn import your_turn


def library_bytes(layers, kv_heads, head_dim, dtype_bytes):
    return 2 * layers * kv_heads * head_dim * dtype_bytes


INPUTS = [(32, 8, 128, 2), (80, 8, 128, 2), (30, 3, 64, 4)]


def test_unwritten_falls_back_to_the_library(capsys):
    def kv_bytes(layers, kv_heads, head_dim, dtype_bytes):
        raise NotImplementedError

    assert your_turn(kv_bytes, library_bytes, INPUTS) is library_bytes
    assert "not written yet" in capsys.readouterr().out


def test_a_wrong_answer_that_runs_fails_with_the_input_and_both_results():
    def kv_bytes(layers, kv_heads, head_dim, dtype_bytes):  # forgot V: half the bytes
        return layers * kv_heads * head_dim * dtype_bytes

    with pytest.raises(AssertionError, match=r"kv_bytes\(32, 8, 128, 2\) gives 65536; kvlab's gives 131072"):
        your_turn(kv_bytes, library_bytes, INPUTS)


def test_a_right_answer_is_returned(capsys):
    def kv_bytes(layers, kv_heads, head_dim, dtype_bytes):
        return layers * kv_heads * head_dim * dtype_bytes * 2

    assert your_turn(kv_bytes, library_bytes, INPUTS) is kv_bytes
    assert "all 3 inputs" in capsys.readouterr().out


def test_tensors_compare_within_tolerance_and_by_shape():
    def library_mask(n):
        return torch.ones(n, n, dtype=torch.bool).tril()

    def transposed(n):  # runs, right shape, wrong mask
        return torch.ones(n, n, dtype=torch.bool).triu()

    def right(n):
        return torch.arange(n)[:, None] >= torch.arange(n)[None, :]

    with pytest.raises(AssertionError, match="transposed"):
        your_turn(transposed, library_mask, [(3,)])
    assert your_turn(right, library_mask, [(3,), (5,)]) is right
    with pytest.raises(AssertionError):
        your_turn(lambda n: right(n)[:-1], library_mask, [(3,)])
    assert your_turn(lambda x: x + 1e-7, lambda x: x, [(torch.ones(4),)], atol=1e-6)


def test_no_inputs_is_refused():
    with pytest.raises(ValueError, match="at least one"):
        your_turn(library_bytes, library_bytes, [])


def test_a_long_argument_is_shown_by_its_name():
    from kvlab.config import load_config

    config = load_config("llama-3.1-70b")
    with pytest.raises(AssertionError, match=r"LlamaConfig\('llama-3.1-70b'\)"):
        your_turn(lambda c: c.num_hidden_layers + 1, lambda c: c.num_hidden_layers, [(config,)])


def test_a_float_where_kvlab_gives_an_int_fails_even_when_equal():
    def kv_bytes(layers, kv_heads, head_dim, dtype_bytes):  # true division: 327680.0, not 327680
        return 2 * layers * kv_heads / 1 * head_dim * dtype_bytes

    with pytest.raises(AssertionError, match=r"gives 131072\.0 \(a float\); kvlab's gives 131072$"):
        your_turn(kv_bytes, library_bytes, INPUTS)


def test_a_tensor_mismatch_names_the_shapes_or_the_first_difference():
    weight = torch.arange(12.0).reshape(4, 3)
    with pytest.raises(AssertionError, match=r"shapes: yours \(2, 2, 3\), kvlab's \(4, 3\)"):
        your_turn(lambda w: w.reshape(2, 2, 3), lambda w: w, [(weight,)])
    with pytest.raises(AssertionError, match=r"first difference at index \(1, 2\): yours 0, "
                                             r"kvlab's 5; largest \|difference\| 5"):
        your_turn(lambda w: w * (w != 5), lambda w: w, [(weight,)])


def test_bytes_are_shown_in_hex():
    with pytest.raises(AssertionError, match=r"gives bytes 0102; kvlab's gives bytes 0103"):
        your_turn(lambda: b"\x01\x02", lambda: b"\x01\x03", [()])


def test_floats_equal_but_for_rounding_pass_and_others_fail():
    terms = (0.1, 0.2, 0.3)
    assert your_turn(lambda: terms[2] + terms[1] + terms[0], lambda: sum(terms), [()])
    with pytest.raises(AssertionError, match="gives 0.6000001"):
        your_turn(lambda: 0.6000001, lambda: sum(terms), [()])


def test_long_objects_in_a_list_are_shown_by_their_first_field():
    from kvlab.serving import Request

    running = [Request(i, 0.0, 40, 8, trace_block_ids=tuple(range(20))) for i in range(3)]
    with pytest.raises(AssertionError, match=r"pick\(\[Request\(request_id=0, \.\.\.\), Request\("
                                             r"request_id=1, \.\.\.\), Request\(request_id=2, \.\.\.\)\]\) "
                                             r"gives Request\(request_id=0, \.\.\.\); kvlab's gives "
                                             r"Request\(request_id=2, \.\.\.\)"):
        def pick(running):
            return running[0]
        your_turn(pick, lambda running: running[-1], [(running,)])
