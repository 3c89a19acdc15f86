"""Sampling: greedy, temperature, top-k, top-p and per-request seeds."""

import math
from collections import Counter

import pytest
import torch

from connectors.ec import FilesystemECStore
from services.decode.stage import DecodeStage
from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.sampler import sample
from services.engine.sequence import RequestError, SamplingParams
from services.prefill.stage import PrefillStage


def draws(logits, params, n=3000):
    return Counter(sample(logits[None].float(), [SamplingParams(**params, seed=s)], [0])[0] for s in range(n))


def test_temperature_follows_the_softmax():
    counts = draws(torch.tensor([0.0, math.log(3.0)]), {"temperature": 1.0})
    assert abs(counts[1] / 3000 - 0.75) < 0.03
    sharper = draws(torch.tensor([0.0, math.log(3.0)]), {"temperature": 0.5})
    assert abs(sharper[1] / 3000 - 0.9) < 0.03


def test_top_k_and_top_p_cut_the_tail():
    logits = torch.log(torch.tensor([0.1, 0.5, 0.2, 0.15, 0.05]))
    assert set(draws(logits, {"top_k": 2})) == {1, 2}
    assert set(draws(logits, {"top_p": 0.6})) == {1, 2}  # 0.5 then 0.2 reaches 0.7 >= 0.6
    assert set(draws(logits, {"top_k": 1})) == {1}


def test_greedy_takes_the_argmax_per_row():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 1.0]])
    greedy = SamplingParams(temperature=0.0)
    assert sample(logits, [greedy, greedy], [0, 0]) == [1, 0]


@pytest.mark.parametrize("bad", [{"temperature": -1}, {"top_p": 0}, {"top_k": -2}, {"max_tokens": 0}])
def test_out_of_range_parameters_are_rejected(bad):
    with pytest.raises(RequestError):
        SamplingParams(**bad)


def generate(engine, prompts, params):
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, sp)
    out = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return [out[str(i)] for i in range(len(prompts))]


def test_seeded_requests_repeat_alone_batched_and_disaggregated(tiny_checkpoint, tmp_path):
    seeded = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    other = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    engine = LLMEngine(tiny_checkpoint, EngineConfig(num_blocks=128))
    [alone] = generate(engine, [[1, 2, 3]], [seeded])
    batched = generate(engine, [[9, 8], [1, 2, 3], [4, 4, 4, 4]], [other, seeded, other])
    assert batched[1] == alone
    [reseeded] = generate(engine, [[1, 2, 3]], [SamplingParams(**{**seeded.__dict__, "seed": 99})])
    assert reseeded != alone

    prefill = PrefillStage(tiny_checkpoint, EngineConfig(num_blocks=32), FilesystemECStore(tmp_path, max_bytes=1 << 20))
    decode = DecodeStage(tiny_checkpoint, EngineConfig(num_blocks=32))
    prefill.submit("r", [1, 2, 3], seeded)
    [first] = prefill.step()
    decode.accept(first.handoff)
    prefill.confirm("r")
    tokens = [first.first_token]
    while decode.has_unfinished():
        tokens += [t for o in decode.step() for t in o.new_token_ids]
    assert tokens == alone
