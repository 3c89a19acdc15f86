"""The reference: Hugging Face transformers on the same checkpoint, with its own prompt processing."""

from __future__ import annotations

import torch
from transformers import AutoTokenizer, GenerationConfig, Qwen2_5_VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

IMAGE_PAD = "<|image_pad|>"


def template_messages(messages: list[dict]) -> list[dict]:
    """Chat messages as HF's chat template wants them: every image part reduced to a marker."""
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            content = [{"type": "image"} if "image" in p["type"] else p for p in content]
        out.append({"role": m["role"], "content": content})
    return out


class HFReference:
    def __init__(self, checkpoint_dir, device: str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        self.device = device
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(checkpoint_dir), dtype=dtype)
        self.model = model.to(device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(str(checkpoint_dir))
        self.image_processor = Qwen2VLImageProcessorPil.from_pretrained(str(checkpoint_dir))
        self.image_token_id = self.model.config.image_token_id

    def inputs(self, messages: list[dict], images: list) -> dict:
        """What Qwen2.5-VL's HF processor builds: each image pad expanded to grid/merge² tokens."""
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        kwargs = {}
        if images:
            processed = self.image_processor(images=images, return_tensors="pt")
            merge = self.image_processor.merge_size**2
            for grid in processed["image_grid_thw"]:
                text = text.replace(IMAGE_PAD, "<|placeholder|>" * int(grid.prod() // merge), 1)
            text = text.replace("<|placeholder|>", IMAGE_PAD)
            kwargs = {"pixel_values": processed["pixel_values"], "image_grid_thw": processed["image_grid_thw"]}
        ids = self.tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        kwargs.update(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            mm_token_type_ids=(ids == self.image_token_id).int(),
        )
        return kwargs

    @torch.inference_mode()
    def generate(self, messages: list[dict], images: list, max_new_tokens: int, stop_at_eos: bool = False) -> list[int]:
        inputs = self.inputs(messages, images)
        config = GenerationConfig(
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=self.model.generation_config.eos_token_id if stop_at_eos else None,
            pad_token_id=self.model.generation_config.pad_token_id,
        )
        inputs = {k: v.to(self.device) for k, v in inputs.items()}
        out = self.model.generate(**inputs, generation_config=config)
        return out[0, inputs["input_ids"].shape[1] :].tolist()
