"""Pool requests on the wire <-> the engine's types, checked (RequestError says what is wrong)."""

from __future__ import annotations

from connectors.ec import validate_key
from services.engine.sequence import FeatureSpec, FinishReason, RequestError, SamplingParams
from services.rpc import epd_pb2


def sampling_from_proto(sampling: epd_pb2.Sampling) -> SamplingParams:
    return SamplingParams(
        max_tokens=sampling.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p or 1.0,  # proto3 cannot leave a float unset; 0 is outside (0, 1] anyway
        top_k=sampling.top_k,
        seed=sampling.seed if sampling.HasField("seed") else None,
        stop_token_ids=tuple(sampling.stop_token_ids),
        ignore_eos=sampling.ignore_eos,
    )


def features_from_proto(features: list[epd_pb2.FeatureSpec]) -> list[FeatureSpec]:
    out = []
    for i, spec in enumerate(features):
        if len(spec.grid_thw) != 3:
            raise RequestError(f"features[{i}].grid_thw must be (t, h, w), got {list(spec.grid_thw)}")
        try:
            validate_key(spec.key)
        except ValueError as exc:
            raise RequestError(f"features[{i}]: {exc}") from None
        out.append(FeatureSpec(spec.key, spec.offset, spec.length, tuple(spec.grid_thw)))
    return out


def request_id_of(request_id: str) -> str:
    if not request_id:
        raise RequestError("request_id is required")
    return request_id


def finish_reason(reason: FinishReason | None) -> str:
    return reason.value if reason is not None else ""
