"""The in-forward checks on the path a CUDA graph holds (otel_swa.device.gate), driven on the CPU: the
sampling flag set and unset, faults injected, and the counts compared with an eager step's."""

from __future__ import annotations

import pytest
import torch

from otel_swa.device.gate import SamplingGate
from otel_swa.device.read_check import ReadCheck, read_counts, read_offender_fields
from otel_swa.device.write_check import WriteCheck, write_counts, write_offender_fields
from otel_swa.reporter import SwaDivergenceReporter
from otel_swa.views import SwaBatch

import decode_loop


def test_the_flag_is_written_only_when_the_decision_changes():
    gate = SamplingGate("cpu")
    writes = []
    flag = gate.flag
    original = flag.fill_
    gate.flag = type("Flag", (), {"fill_": lambda self, v: writes.append(v) or original(v)})()
    for due in (False, True, True, False, False, True):
        gate.set(due)
    assert writes == [True, False, True]
    assert bool(flag) is True and gate.due is True


def test_the_recorded_path_is_taken_only_under_capture_or_when_forced():
    gate = SamplingGate("cpu")
    assert not gate.recording() and not gate.wanted()
    with gate.region() as mask:
        assert mask is None
    gate.force_recorded = True
    assert gate.recording() and gate.wanted()
    with gate.region() as mask:
        assert mask is gate.flag
    assert gate.recorded_calls == 1
    with pytest.raises(ValueError, match="graph_mode"):
        SamplingGate("cpu", graph_mode="always")


# ---------------------------------------------------------------------- the read check
def read_case(fault: bool):
    """One sliding-window layer's inputs: 6 requests of 20 tokens, window 5, the engine's output
    computed over the mapping's slots; with ``fault`` request 2's output over the raw FULL slots."""
    gen = torch.Generator().manual_seed(0)
    batch, width, heads, dim, window = 6, 20, 2, 8, 5
    r2t = (torch.arange(batch * width, dtype=torch.int32) + 1).reshape(batch, width)
    slots = batch * width + 1
    mapping = torch.cat([torch.zeros(1, dtype=torch.int64), torch.randperm(slots - 1, generator=gen) + 1])
    k, v = torch.randn((slots, heads, dim), generator=gen), torch.randn((slots, heads, dim), generator=gen)
    q = torch.randn((batch, heads, dim), generator=gen)
    keys = r2t[:, width - window:].long()
    read = mapping[keys].clone()
    if fault:
        read[2] = keys[2]
    scores = torch.einsum("bhd,bwhd->bhw", q, k[read]) / dim**0.5
    out = torch.einsum("bhw,bwhd->bhd", scores.softmax(-1), v[read])
    args = dict(layer_id=3, q=q, out=out, k_buffer=k, v_buffer=v, req_to_token=r2t, full_to_swa_index_mapping=mapping,
                req_pool_indices=torch.arange(batch), seq_lens=torch.full((batch,), width), query_rows=None,
                window=window, scaling=1 / dim**0.5, num_q_heads=heads)
    return args


@pytest.mark.parametrize("fault", [False, True])
def test_a_recorded_read_check_counts_as_an_eager_one_when_flagged_and_nothing_when_not(fault):
    args = read_case(fault)
    eager = ReadCheck("cpu", max_queries=4)
    gate = SamplingGate("cpu")
    gate.force_recorded = True
    recorded = ReadCheck("cpu", max_queries=4, gate=gate)
    for turn in range(3):  # rotating over the batch: requests 0-3, 4 5 0 1, 2-5
        eager.check_layer(**args)
        expected = eager.take().tolist()
        gate.set(False)  # a replay of a non-sampled step: the work runs, nothing counts
        recorded.check_layer(**args)
        assert recorded.cells.tolist() == [0] * len(expected)
        gate.set(True)  # a replay of a sampled step
        recorded.check_layer(**args)
        got = recorded.take().tolist()
        assert got == expected, turn
        assert read_counts(got)[0] == 4
        mismatched = read_counts(got)[1]
        assert mismatched == (1 if fault and turn in (0, 2) else 0)
        if mismatched:
            assert read_offender_fields(got)["entry"] == 2
    assert recorded.recorded_calls == 6


# ---------------------------------------------------------------------- the write check
def write_case(wrong_index: bool, tokens: int = 5):
    """A layer's store of ``tokens`` new tokens (FULL slots 11..; slot 0 for the last one when
    ``tokens`` > 5: padding) into an SWA pool at mapping[FULL]; with ``wrong_index`` at the FULL slot."""
    gen = torch.Generator().manual_seed(1)
    slots = 64
    mapping = torch.zeros(slots, dtype=torch.int64)
    mapping[11:11 + tokens] = torch.arange(40, 40 + tokens)
    loc = torch.arange(11, 11 + tokens)
    if tokens > 5:
        loc[-1] = 0
    k_buffer, v_buffer = torch.zeros((slots, 2, 4)), torch.zeros((slots, 2, 4))
    k, v = torch.randn((tokens, 8), generator=gen), torch.randn((tokens, 8), generator=gen)
    at = loc if wrong_index else mapping[loc]
    k_buffer[at], v_buffer[at] = k.view(tokens, 2, 4), v.view(tokens, 2, 4)
    return dict(layer_id=2, swa=True, k=k, v=v, k_buffer=k_buffer, v_buffer=v_buffer, out_cache_loc=loc,
                full_to_swa_index_mapping=mapping, positions=torch.arange(100, 100 + tokens))


@pytest.mark.parametrize("wrong_index", [False, True])
def test_a_recorded_write_check_counts_as_an_eager_one(wrong_index):
    args = write_case(wrong_index)
    eager_gate, gate = SamplingGate("cpu"), SamplingGate("cpu")
    gate.force_recorded = True
    eager, recorded = WriteCheck("cpu", eager_gate, max_tokens=3), WriteCheck("cpu", gate, max_tokens=3)
    for turn in range(2):
        eager.check_layer(**args)
        expected = eager.take().tolist()
        gate.set(False)
        recorded.check_layer(**args)
        assert recorded.cells.tolist() == [0] * len(expected)
        gate.set(True)
        recorded.check_layer(**args)
        got = recorded.take().tolist()
        assert got == expected
        first = 3 * turn % 5  # tokens 0-2, then 3, 4, 0
        assert write_counts(got) == (3, 3 if wrong_index else 0, 0)
        if wrong_index:
            assert write_offender_fields(got) == dict(entry=first, position=100 + first, full_slot=11 + first,
                                                      swa_slot=40 + first, layer=2, pool="swa")
        else:
            assert write_offender_fields(got) is None


def test_padding_tokens_are_not_counted_and_float32_given_to_a_bfloat16_cache_compares_exactly():
    args = write_case(False, tokens=7)  # token 6 is padding (slot 0)
    args["k_buffer"], args["v_buffer"] = args["k_buffer"].bfloat16(), args["v_buffer"].bfloat16()
    check = WriteCheck("cpu", SamplingGate("cpu"), max_tokens=8)
    check.check_layer(**args)
    assert write_counts(check.take().tolist()) == (6, 0, 0)
    args["k_buffer"][42, 1, 3] += 1.0  # token 2's stored K changed
    check.check_layer(**args)
    got = check.take().tolist()
    assert write_counts(got) == (6, 1, 0) and write_offender_fields(got)["entry"] == 2


def test_a_cache_that_cannot_be_compared_is_counted_unchecked():
    args = write_case(False)
    args["k_buffer"] = args["k_buffer"].to(torch.uint8)  # an fp8 cache stored as bytes
    check = WriteCheck("cpu", SamplingGate("cpu"), max_tokens=8)
    check.check_layer(**args)
    assert write_counts(check.take().tolist()) == (0, 0, 5)
    args = write_case(False)
    args["full_to_swa_index_mapping"] = None  # an SWA layer without its mapping
    check.check_layer(**args)
    assert write_counts(check.take().tolist()) == (0, 0, 5)


# ---------------------------------------------------------------------- the reporter's flag
def test_before_forward_sets_the_flag_of_each_sampling_step():
    reporter = SwaDivergenceReporter(3)
    view = SwaBatch(torch.tensor([[0, 0], [1, 2]], dtype=torch.int32), torch.tensor([0, 1, 2]), torch.tensor([1]),
                    torch.tensor([2]), seq_lens_cpu=[2])
    flags, wanted = [], []
    for _ in range(7):
        reporter.before_forward()
        flags.append(bool(reporter.sampling_flag))
        wanted.append(reporter.checks_wanted())
        reporter.step(view)
    assert flags == wanted == [False, False, True, False, False, True, False]
    reporter.gate.force_recorded = True
    assert reporter.checks_wanted()
    reporter.close()
    assert not reporter.checks_wanted()


def test_before_forward_follows_a_round_of_micro_batches():
    reporter = SwaDivergenceReporter(4, micro_batches="every")
    reporter._forward_ct = 3
    reporter.before_forward(micro_batch=0)
    assert bool(reporter.sampling_flag)
    reporter._forward_ct, reporter._round = 4, {0}
    reporter.before_forward(micro_batch=1)
    assert bool(reporter.sampling_flag)
    reporter.before_forward(micro_batch=0)
    assert not bool(reporter.sampling_flag)
    with pytest.raises(ValueError, match="micro_batch"):
        reporter.before_forward(micro_batch=-1)


# ---------------------------------------------------------------------- a decode loop, both ways
@pytest.mark.parametrize("fault_at", [None, 4])
def test_a_decode_loop_on_the_recorded_path_gives_the_eager_readings(fault_at):
    """The loop a CUDA graph would replay, every step on the recorded path (the flag set only at
    sampled steps) against the same loop eager: equal readings at every sample, with and without a
    wrong-index write from step 4."""
    eager = decode_loop.run("cpu", mode="eager", fault_at=fault_at)
    recorded = decode_loop.run("cpu", mode="recorded", fault_at=fault_at)
    assert [step for step, _ in eager] == [step for step, _ in recorded] == [2, 4, 6, 8]
    assert [decode_loop.summary(r) for _, r in eager] == [decode_loop.summary(r) for _, r in recorded]
    for step, reading in eager:
        faulty = fault_at is not None and step >= fault_at
        assert reading.read == (4, 0, 0)  # the mapping's KV is what attention read, fault or not
        assert reading.write[:2] == (8, 4 if faulty else 0)  # 4 tokens x one layer of each pool
        assert (reading.provenance.corrupt_tokens > 0) == faulty
        assert reading.provenance.foreign_tokens == 0
        if faulty:
            assert reading.write_offender["layer"] == 1 and reading.provenance.corrupt_offender["pool"] == "swa"
