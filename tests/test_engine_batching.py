"""Continuous batching: sequences decoded together give exactly what each gives alone."""

import random

import pytest

from connectors.kv import KVHandoff
from services.decode.stage import DecodeStage
from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.sequence import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
CONFIG = EngineConfig(block_size=4, num_blocks=512, max_num_seqs=16)


def prompts(n=8, vocab=1400):
    rng = random.Random(0)
    return [[rng.randrange(vocab) for _ in range(3 + 7 * i)] for i in range(n)]


def run(engine, until_done=True):
    out = {}
    while engine.has_unfinished():
        for o in engine.step():
            assert o.error is None
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return LLMEngine(tiny_checkpoint, CONFIG)


@pytest.fixture(scope="module")
def alone(engine):
    results = []
    for i, p in enumerate(prompts()):
        engine.add_request(f"alone-{i}", p, GREEDY)
        results.append(run(engine)[f"alone-{i}"])
    return results


def test_eight_sequences_together_equal_alone(engine, alone):
    for i, p in enumerate(prompts()):
        engine.add_request(str(i), p, GREEDY)
    together = run(engine)
    assert [together[str(i)] for i in range(8)] == alone
    assert engine.blocks.num_free == CONFIG.num_blocks and engine.blocks.reserved == 0


def test_a_sequence_joining_mid_decode_equals_alone(engine, alone):
    ps = prompts()
    for i in range(7):
        engine.add_request(str(i), ps[i], GREEDY)
    out = {}
    for _ in range(6):  # the first seven are several tokens into decode
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert all(len(out[str(i)]) > 1 for i in range(7))
    engine.add_request("7", ps[7], GREEDY)
    for rid, tokens in run(engine).items():
        out.setdefault(rid, []).extend(tokens)
    assert [out[str(i)] for i in range(8)] == alone


def test_handoffs_joining_a_running_decode_batch_equal_alone(tiny_checkpoint, alone):
    """Prefill in one engine, decode in another whose batch is already running."""
    prefill = LLMEngine(tiny_checkpoint, EngineConfig(role="prefill", block_size=16, num_blocks=128))
    decode = DecodeStage(tiny_checkpoint, EngineConfig(block_size=4, num_blocks=512))
    out = {}
    for i, p in enumerate(prompts()):
        prefill.add_request(str(i), p, GREEDY)
        for o in prefill.step():
            out[o.request_id] = list(o.new_token_ids)
            decode.accept(KVHandoff.from_bytes(prefill.export_handoff(o.request_id).to_bytes()))
            prefill.release_handoff(o.request_id)
        for o in decode.step():  # earlier requests advance while later ones arrive
            out[o.request_id].extend(o.new_token_ids)
    for rid, tokens in run(decode.engine).items():
        out[rid].extend(tokens)
    assert [out[str(i)] for i in range(8)] == alone
    for e in (prefill, decode.engine):
        assert e.blocks.num_free == e.blocks.num_blocks and e.blocks.reserved == 0


def test_pd_engine_resumes_held_sequences_in_place(tiny_checkpoint, alone):
    """A PD worker prefills, holds the KV, then decodes it in the same pool without a copy."""
    pd = LLMEngine(tiny_checkpoint, EngineConfig(role="pd", block_size=4, num_blocks=512))
    for i, p in enumerate(prompts()):
        pd.add_request(str(i), p, GREEDY)
    out = {}
    while len(out) < 8:
        for o in pd.step():
            out[o.request_id] = list(o.new_token_ids)
    assert pd.num_held() == 8 and not pd.has_unfinished()
    for i in range(8):
        pd.resume(str(i))
    for rid, tokens in run(pd).items():
        out[rid].extend(tokens)
    assert [out[str(i)] for i in range(8)] == alone
    assert pd.blocks.num_free == 512 and pd.num_held() == 0
