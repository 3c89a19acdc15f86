"""The README's first command: `python -m services.cluster` brings the cluster up and Ctrl-C ends it."""

import base64
import os
import re
import signal
import socket
import subprocess
import sys
import time

import openai
import pytest

from services.cluster import free_port
from tests.conftest import make_image, png_bytes
from tests.hf_reference import HFReference


def wait_for_line(process, marker, timeout_s=240):
    deadline, lines = time.monotonic() + timeout_s, []
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line)
        if marker in line:
            return lines
    raise AssertionError("cluster did not come up:\n" + "".join(lines))


@pytest.mark.parametrize("layout", [["--ec", "redis", "--pd"], ["--encoders", "1"]], ids=["redis-pd", "fs-separate"])
def test_one_command_serves_a_multimodal_request_and_stops_cleanly(tiny_checkpoint, tmp_path, layout):
    port = free_port()
    command = [sys.executable, "-m", "services.cluster", "--checkpoint", str(tiny_checkpoint), "--port", str(port),
               "--grpc-port", str(free_port()), "--workdir", str(tmp_path), *layout]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        lines = wait_for_line(process, "EPD cluster ready")
        assert f"http://127.0.0.1:{port}/v1" in lines[-1]
        output = "".join(lines + [process.stdout.readline() for _ in range(4)])
        ports = [int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)", output)]
        image = make_image(120, 90, 5)
        url = "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                 {"type": "text", "text": "What is this?"}]}]  # fmt: skip
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(
            model=tiny_checkpoint.name,
            messages=messages,
            temperature=0.0,
            max_tokens=16,
            extra_body={"ignore_eos": True},
        )
        reference = HFReference(tiny_checkpoint)
        template = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
        tokens = reference.generate(template, [image], 16)
        assert reply.choices[0].message.content == reference.tokenizer.decode(tokens, skip_special_tokens=True)
    finally:
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=90) == 0
    assert ports and not [p for p in ports if listening(p)]  # every service is gone


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0
