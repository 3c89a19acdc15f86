"""The EPD proxy: OpenAI-compatible HTTP and gRPC front door over the encoder, prefill and decode pools."""
