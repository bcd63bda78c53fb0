"""respool against a live llama-cpp-python server (a developer's tool: the guide asks for a real
server before an issue touching the upstream path is resolved; no test runs one, as building it takes
minutes).

    python -m uv venv /tmp/llama --python 3.12
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAMA_CURL=OFF" python -m uv pip install --python /tmp/llama/bin/python \\
        'llama-cpp-python[server]==0.3.36' gguf numpy                      # about 10 minutes on 2 cores
    /tmp/llama/bin/python tools/live_llamacpp.py model /tmp/tiny.gguf     # a tiny llama, random weights
    /tmp/llama/bin/python -m llama_cpp.server --model /tmp/tiny.gguf --model_alias tiny --port 8011 --n_ctx 512 &
    RESPOOL_DATA_DIR=/tmp/tiny-data RESPOOL_UPSTREAM_URL=http://127.0.0.1:8011/v1 RESPOOL_UPSTREAM_API=chat \\
        .venv/bin/respool up --port 8012 &
    .venv/bin/python tools/live_llamacpp.py check http://127.0.0.1:8012/v1

`check` creates a response of each kind (foreground and background, streamed and not), each ended by
`max_output_tokens` (`incomplete`: the model's words are random), and asserts what every fault test
asks of a stream: numbered 0..n, one terminal event, its events adding up to the stored Response,
and (streamed) the deltas a client read equal to the stored text.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TERMINAL = ("response.completed", "response.failed", "response.incomplete")


def model(path: str) -> None:
    """A llama GGUF of two layers, 64 wide, a byte-level vocabulary and a ChatML template."""
    import gguf  # type: ignore[import-not-found]
    import numpy as np

    rng = np.random.default_rng(0)
    n_embd, n_ff, n_layer, n_head = 64, 128, 2, 4
    words = ["hello", "world", "the", "a", "respool", "tok", "yes", "no", "and", "ok"]
    letters = [*"abcdefghijklmnopqrstuvwxyz", "▁"]
    tokens = [
        "<unk>",
        "<s>",
        "</s>",
        *(f"<0x{b:02X}>" for b in range(256)),
        *("▁" + w for w in words),
        *letters,
    ]
    kinds = gguf.TokenType
    types = [kinds.UNKNOWN, kinds.CONTROL, kinds.CONTROL] + [kinds.BYTE] * 256
    types += [kinds.NORMAL] * (len(words) + len(letters))
    scores = [0.0] * 259 + [-1.0] * len(words) + [-5.0] * len(letters)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("tiny-random")
    writer.add_context_length(512)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(n_embd // n_head)
    writer.add_vocab_size(len(tokens))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )

    def weights(name: str, *shape: int) -> None:
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.2).astype(np.float32))

    def ones(name: str) -> None:
        writer.add_tensor(name, np.ones(n_embd, dtype=np.float32))

    weights("token_embd.weight", len(tokens), n_embd)
    ones("output_norm.weight")
    weights("output.weight", len(tokens), n_embd)
    for layer in range(n_layer):
        ones(f"blk.{layer}.attn_norm.weight")
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            weights(f"blk.{layer}.{name}.weight", n_embd, n_embd)
        ones(f"blk.{layer}.ffn_norm.weight")
        weights(f"blk.{layer}.ffn_gate.weight", n_ff, n_embd)
        weights(f"blk.{layer}.ffn_up.weight", n_ff, n_embd)
        weights(f"blk.{layer}.ffn_down.weight", n_embd, n_ff)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"wrote {path}: {len(tokens)} tokens")


def check(base_url: str, model_name: str = "tiny") -> None:
    from openai import OpenAI

    from worker.translation.output import output_items
    from worker.translation.replay import rebuild

    client = OpenAI(base_url=base_url, api_key="unused")

    def adds_up(response_id: str) -> dict[str, Any]:
        stored = client.responses.retrieve(response_id).model_dump(mode="json", exclude_unset=True)
        stream = client.responses.retrieve(response_id, stream=True)
        events = [event.model_dump(mode="json", exclude_unset=True) for event in stream]
        assert [e["sequence_number"] for e in events] == list(range(len(events))), response_id
        assert [e["type"] for e in events if e["type"] in TERMINAL] == [events[-1]["type"]], response_id
        assert output_items(rebuild(events)) == stored["output"], f"{response_id}: events do not add up"
        print(f"  {stored['status']}, {len(events)} events, {stored['output'][0]['content'][0]['text']!r}")
        return stored

    for background in (False, True):
        print("background" if background else "foreground", "not streamed")
        response = client.responses.create(
            model=model_name, input="hello world", max_output_tokens=12, background=background
        )
        while response.status in ("queued", "in_progress"):
            time.sleep(0.2)
            response = client.responses.retrieve(response.id)
        adds_up(response.id)
    for background in (False, True):
        print("background" if background else "foreground", "streamed")
        with client.responses.create(
            model=model_name, input="hello world", max_output_tokens=12, stream=True, background=background
        ) as stream:
            told = list(stream)
        stored = adds_up(told[0].response.id)  # type: ignore[union-attr]
        deltas = "".join(e.delta for e in told if e.type == "response.output_text.delta")  # type: ignore[union-attr]
        assert deltas == stored["output"][0]["content"][0]["text"]
    print("ok")


if __name__ == "__main__":
    {"model": model, "check": check}[sys.argv[1]](*sys.argv[2:])
