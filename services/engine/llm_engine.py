"""The language-model engine behind the prefill and decode stages.

One step = schedule -> run -> sample -> apply stops. Role "both" prefills and
decodes; "prefill" stops each request after its first token and keeps its KV
blocks until they are exported; "decode" takes exported requests in and decodes.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path

import blake3

from connectors.ec import ECConsumer
from connectors.kv import HandoffState, KVHandoff, KVHandoffError
from services.engine.block_manager import BlockManager
from services.engine.config import EngineConfig
from services.engine.features import check_placeholders, fetch_features, missing_keys
from services.engine.model_runner import ModelRunner
from services.engine.sampler import sample
from services.engine.scheduler import Scheduler
from services.engine.sequence import (
    ErrorKind,
    FeatureSpec,
    FinishReason,
    RequestError,
    SamplingParams,
    Sequence,
    Status,
    StepOutput,
)
from services.models.checkpoint import Checkpoint, open_checkpoint
from services.models.registry import family_of, load_language_model


class LLMEngine:
    def __init__(self, checkpoint: str | Path | Checkpoint, config: EngineConfig, ec: ECConsumer | None = None):
        ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else open_checkpoint(checkpoint)
        self.config = config
        self.ec = ec
        self.family = family_of(ckpt)
        self.model = load_language_model(ckpt, config.torch_device, config.torch_dtype)
        self.model_cfg = self.model.cfg
        self.fingerprint = _fingerprint(self.model_cfg)
        self.eos_ids = _eos_ids(ckpt)
        model_len = self.model_cfg.max_position_embeddings
        self.max_model_len = min(config.max_model_len or model_len, model_len)
        self.blocks = BlockManager(config.num_blocks, config.block_size)
        self.runner = ModelRunner(self.model, config.num_blocks, config.block_size, config.torch_device)
        self.scheduler = Scheduler(config, self.blocks, self._features_ready)
        self.seqs: dict[str, Sequence] = {}
        self.pending_imports: deque[Sequence] = deque()
        self._pending_kv: dict[str, KVHandoff] = {}
        self._ready: set[str] = set()

    # ------------------------------------------------------------------ requests in

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        features: Iterable[FeatureSpec] = (),
    ) -> None:
        """Queue a prompt for prefill. Raises RequestError if it cannot be served as given."""
        if self.config.role == "decode":
            raise RequestError("this engine only decodes; send prompts to a prefill engine")
        seq = Sequence(request_id, list(prompt_ids), sampling, sorted(features, key=lambda f: f.offset))
        self._validate(seq)
        seq.prompt_positions, seq.mrope_delta = self.family.mrope_positions(
            len(seq.prompt_ids), [(f.offset, f.grid_thw) for f in seq.features], self.model_cfg.spatial_merge_size
        )
        seq.feature_deadline = time.monotonic() + self.config.feature_timeout_s
        self.seqs[request_id] = seq
        self.scheduler.add(seq)

    def add_handoff(self, handoff: KVHandoff) -> None:
        """Take in a sequence prefilled elsewhere; it joins the decode batch when blocks allow."""
        state = handoff.state
        self._check_handoff(handoff)
        sampling = SamplingParams(**{**state.sampling, "stop_token_ids": tuple(state.sampling["stop_token_ids"])})
        seq = Sequence(state.request_id, list(state.prompt_ids), sampling, output_ids=list(state.output_ids))
        seq.mrope_delta, seq.num_cached = state.mrope_delta, state.num_cached
        if (
            seq.max_total_tokens > self.max_model_len
            or self.blocks.blocks_for(seq.max_total_tokens) > self.blocks.num_blocks
        ):
            raise RequestError(f"request {seq.request_id} does not fit this decode engine's context or KV pool")
        self.seqs[seq.request_id] = seq
        self._pending_kv[seq.request_id] = handoff
        self.pending_imports.append(seq)

    def abort(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return
        if seq in self.pending_imports:
            self.pending_imports.remove(seq)
            self._pending_kv.pop(request_id, None)
        self.scheduler.finish(seq)
        self._ready.discard(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running or self.pending_imports)

    def num_held(self) -> int:
        """Sequences holding KV blocks while they wait to be exported or resumed."""
        return sum(1 for s in self.seqs.values() if s.status is Status.AWAITING_HANDOFF)

    # ------------------------------------------------------------------ one step

    def step(self) -> list[StepOutput]:
        outputs = [self._fail(s, self._timeout_message(s), ErrorKind.FEATURE_TIMEOUT) for s in self.scheduler.expired()]
        self._import_pending()
        batch = self.scheduler.schedule()
        if batch is None:
            return outputs
        if batch.kind == "prefill":
            seqs, features = self._fetch_features(batch.seqs, outputs)
            if not seqs:
                return outputs
            logits = self.runner.prefill(seqs, features)
            for seq in seqs:
                seq.num_cached = len(seq.prompt_ids)
        else:
            seqs = batch.seqs
            for seq in seqs:
                self.blocks.ensure_capacity(seq, seq.num_tokens)
            logits = self.runner.decode(seqs)
            for seq in seqs:
                seq.num_cached = seq.num_tokens
        tokens = sample(logits, [s.sampling for s in seqs], [len(s.output_ids) for s in seqs])
        for seq, token in zip(seqs, tokens):
            outputs.append(self._append(seq, token, after_prefill=batch.kind == "prefill"))
        return outputs

    # ------------------------------------------------------------------ KV handoff out

    def export_handoff(self, request_id: str) -> KVHandoff:
        seq = self._held(request_id)
        return KVHandoff(self._handoff_state(seq), self.runner.read_kv(seq.block_table, seq.num_cached))

    def handoff_nbytes(self, request_id: str) -> int:
        """Size of export_handoff(request_id).to_bytes(), without copying the K/V."""
        seq = self._held(request_id)
        cfg = self.model_cfg
        shape = [cfg.num_layers, 2, seq.num_cached, cfg.num_kv_heads, cfg.head_dim]
        return KVHandoff.wire_size(self._handoff_state(seq), shape, self.runner.kv_cache.dtype)

    def resume(self, request_id: str) -> None:
        """PD worker: decode a held sequence here, its KV already in this engine's pool."""
        seq = self.seqs.get(request_id)
        if self.config.role != "pd" or seq is None or seq.status is not Status.AWAITING_HANDOFF:
            raise KeyError(f"request {request_id} has no KV held for decoding in this engine")
        self.scheduler.start_running(seq)

    def release_handoff(self, request_id: str) -> None:
        """Free a handed-off sequence's blocks (once the receiver has confirmed, or gave up)."""
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self.scheduler.finish(seq)

    @property
    def num_waiting(self) -> int:
        """Prompts queued for prefill, including those waiting for embeddings."""
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    # ------------------------------------------------------------------ internals

    def _held(self, request_id: str) -> Sequence:
        seq = self.seqs.get(request_id)
        if seq is None or seq.status is not Status.AWAITING_HANDOFF:
            raise KeyError(f"request {request_id} has no KV awaiting handoff")
        return seq

    def _handoff_state(self, seq: Sequence) -> HandoffState:
        return HandoffState(
            request_id=seq.request_id,
            prompt_ids=seq.prompt_ids,
            output_ids=seq.output_ids,
            sampling=asdict(seq.sampling),
            mrope_delta=seq.mrope_delta,
            num_cached=seq.num_cached,
            model=self.fingerprint,
        )

    def _validate(self, seq: Sequence) -> None:
        if not seq.prompt_ids:
            raise RequestError("the prompt is empty")
        if seq.request_id in self.seqs:
            raise RequestError(f"request id {seq.request_id!r} is already in use")
        vocab = self.model_cfg.vocab_size
        if min(seq.prompt_ids) < 0 or max(seq.prompt_ids) >= vocab:
            raise RequestError(f"prompt token ids must be in [0, {vocab})")
        if seq.max_total_tokens > self.max_model_len:
            raise RequestError(
                f"prompt ({len(seq.prompt_ids)} tokens) + max_tokens ({seq.sampling.max_tokens}) exceeds "
                f"the context length {self.max_model_len}; shorten the prompt or lower max_tokens"
            )
        if self.blocks.blocks_for(seq.max_total_tokens) > self.blocks.num_blocks:
            raise RequestError(f"request needs more KV blocks than the pool has ({self.blocks.num_blocks})")
        if seq.features and self.ec is None:
            raise RequestError("the prompt has image features but this engine has no EC store")
        check_placeholders(seq.prompt_ids, seq.features, self.model_cfg.image_token_id)
        merge = self.model_cfg.spatial_merge_size**2
        for f in seq.features:
            t, h, w = f.grid_thw
            if t * h * w != f.length * merge:
                raise RequestError(
                    f"feature {f.key!r}: grid {f.grid_thw} gives {t * h * w // merge} rows, spec says {f.length}"
                )

    def _features_ready(self, seq: Sequence) -> bool:
        if not seq.features or seq.request_id in self._ready:
            return True
        if missing_keys(self.ec, seq.features):
            return False
        self._ready.add(seq.request_id)
        return True

    def _timeout_message(self, seq: Sequence) -> str:
        keys = missing_keys(self.ec, seq.features)
        return f"embeddings {keys} did not arrive in the EC store within {self.config.feature_timeout_s:g} s"

    def _fetch_features(self, seqs: list[Sequence], outputs: list[StepOutput]):
        ok, features = [], {}
        width = self.model_cfg.hidden_size
        for seq in seqs:
            try:
                features[seq.request_id] = fetch_features(self.ec, seq.features, width) if seq.features else []
                ok.append(seq)
            except RequestError as exc:
                outputs.append(self._fail(seq, str(exc), ErrorKind.INVALID))
        return ok, features

    def _append(self, seq: Sequence, token: int, after_prefill: bool) -> StepOutput:
        seq.output_ids.append(token)
        reason = self._stop_reason(seq, token)
        if reason is not None:
            self._finish(seq, reason)
        elif after_prefill and self.config.role in ("prefill", "pd"):
            seq.status = Status.AWAITING_HANDOFF
        elif after_prefill:
            self.scheduler.start_running(seq)
        return StepOutput(seq.request_id, [token], reason is not None, reason)

    def _stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        if token in seq.sampling.stop_token_ids or (token in self.eos_ids and not seq.sampling.ignore_eos):
            return FinishReason.STOP
        if len(seq.output_ids) >= seq.sampling.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.finish_reason = reason
        self.scheduler.finish(seq)
        self.seqs.pop(seq.request_id, None)
        self._ready.discard(seq.request_id)

    def _fail(self, seq: Sequence, message: str, kind: ErrorKind) -> StepOutput:
        seq.error = message
        self._finish(seq, FinishReason.ERROR)
        return StepOutput(seq.request_id, [], True, FinishReason.ERROR, message, kind)

    def _check_handoff(self, handoff: KVHandoff) -> None:
        if self.config.role == "prefill":
            raise KVHandoffError("this engine only prefills; send handoffs to a decode engine")
        if handoff.state.model != self.fingerprint:
            raise KVHandoffError("the handoff was produced by a different language model")
        cfg, kv = self.model_cfg, handoff.kv
        expected = (cfg.num_layers, 2, handoff.state.num_cached, cfg.num_kv_heads, cfg.head_dim)
        if tuple(kv.shape) != expected or kv.dtype != self.runner.kv_cache.dtype:
            raise KVHandoffError(
                f"K/V {tuple(kv.shape)} {kv.dtype} does not match this engine's {expected} {self.runner.kv_cache.dtype}"
            )
        if handoff.state.request_id in self.seqs:
            raise KVHandoffError(f"request id {handoff.state.request_id!r} is already in use")

    def _import_pending(self) -> None:
        while self.pending_imports and len(self.scheduler.running) < self.config.max_num_seqs:
            seq = self.pending_imports[0]
            if not self.blocks.can_admit(seq):
                return
            self.pending_imports.popleft()
            self.blocks.admit(seq, seq.num_cached)
            self.runner.write_kv(seq.block_table, self._pending_kv.pop(seq.request_id).kv)
            self.scheduler.start_running(seq)


def _fingerprint(cfg) -> str:
    return blake3.blake3(repr(asdict(cfg)).encode()).hexdigest()[:32]


def _eos_ids(ckpt: Checkpoint) -> frozenset[int]:
    source = ckpt.read_json("generation_config.json") or {}
    eos = source.get("eos_token_id", ckpt.config.get("eos_token_id"))
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)
