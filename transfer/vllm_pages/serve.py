"""A vLLM engine with a ``VllmPrefill`` and a ``VllmDecode`` in this process, driven over JSON lines (run in vLLM's venv with the
repository on ``PYTHONPATH``; ``transfer.vllm_pages.process.VllmProcess`` is the driver).

Protocol: one JSON object per line on stdin, one reply per line on the original stdout (vLLM's own
output goes to stderr). First reply: ``{"ready": true, "directories": [...], "block_size": n}``. Commands:

* ``{"cmd": "prefill", "prompts": [[ids]]}`` -> ``{"handoffs": [Handoff JSON]}``
* ``{"cmd": "generate", "prompts": [[ids]], "max_tokens": n}`` -> ``{"outputs": [{"tokens": [...],
  "top2": [[logprob, logprob], ...]}]}``: vLLM serving the whole prompt itself, greedy (the reference)
* ``{"cmd": "pages", "handoff": Handoff JSON}`` -> ``{"pages": {name: npy base64}}`` (``VllmPrefill.staged_pages``)
* ``{"cmd": "connect", "directories": [...]}`` -> ``{"engine_id": ...}`` (``VllmDecode.connect``)
* ``{"cmd": "decode", "handoffs": [Handoff JSON], "max_tokens": n}`` -> ``{"tokens": [[...]]}``: vLLM
  continuing another engine's prefills (``VllmDecode.generate``)
* ``{"cmd": "installed"}`` -> ``{"pages": [{name: npy base64}]}`` (``VllmDecode.installed``, the last decode)
* ``{"cmd": "poll"}`` -> ``{"freed": [handoff ids], "num_staged": n}``
* ``{"cmd": "exit"}``; a failing command answers ``{"error": "<class>: <message>"}``.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import sys

import numpy as np

from transfer.staging import Handoff


def _engine(args):
    # Before vLLM is imported: its engine and caches in this process, conv state as (conv_dim, R).
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_SSM_CONV_STATE_LAYOUT"] = "DS"
    from vllm import LLM

    from transfer.vllm_pages.decode import KV_TRANSFER_CONFIG

    return LLM(args.model, dtype=args.dtype, enable_prefix_caching=False, max_model_len=args.max_model_len,
               max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
               async_scheduling=False, enforce_eager=True, skip_tokenizer_init=True, seed=0,
               gpu_memory_utilization=0.05, kv_cache_memory_bytes=args.kv_cache_mib << 20,
               kv_transfer_config=KV_TRANSFER_CONFIG)


def _encode(array) -> str:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()


def _reference(llm, prompts, max_tokens: int) -> list[dict]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
    result = []
    for out in outputs:
        completion = out.outputs[0]
        top2 = [sorted((lp.logprob for lp in step.values()), reverse=True)[:2] for step in completion.logprobs]
        result.append({"tokens": list(completion.token_ids), "top2": top2})
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m transfer.vllm_pages", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--engine-id", default="vllm")
    parser.add_argument("--block-size", type=int, default=None, help="staged KV block size (the decode engine's)")
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--kv-cache-mib", type=int, default=64)
    args = parser.parse_args(argv)
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # vLLM's logs must not interleave with replies

    from transfer.vllm_pages.decode import VllmDecode
    from transfer.vllm_pages.prefill import VllmPrefill

    llm = _engine(args)
    prefill = VllmPrefill(llm, engine_id=args.engine_id, block_size=args.block_size, max_model_len=args.max_model_len)
    decode = VllmDecode(llm, block_size=prefill.block_size, max_model_len=args.max_model_len)
    try:
        replies.write(json.dumps({"ready": True, "block_size": prefill.block_size,
                                  "directories": [d.decode() for d in prefill.directories()]}) + "\n")
        for line in sys.stdin:
            command = json.loads(line)
            if command["cmd"] == "exit":
                break
            try:
                if command["cmd"] == "prefill":
                    reply = {"handoffs": [h.to_bytes().decode() for h in prefill.prefill(command["prompts"])]}
                elif command["cmd"] == "generate":
                    reply = {"outputs": _reference(llm, command["prompts"], int(command["max_tokens"]))}
                elif command["cmd"] == "pages":
                    pages = prefill.staged_pages(Handoff.from_bytes(command["handoff"]))
                    reply = {"pages": {name: _encode(a) for name, a in pages.items()}}
                elif command["cmd"] == "connect":
                    reply = {"engine_id": decode.connect([d.encode() for d in command["directories"]])}
                elif command["cmd"] == "decode":
                    reply = {"tokens": decode.generate([h.encode() for h in command["handoffs"]],
                                                       int(command["max_tokens"]))}
                elif command["cmd"] == "installed":
                    reply = {"pages": [{name: _encode(a) for name, a in pages.items()} for pages in decode.installed]}
                elif command["cmd"] == "poll":
                    reply = {"freed": prefill.poll(), "num_staged": prefill.num_staged}
                else:
                    reply = {"error": f"ValueError: unknown command {command['cmd']!r}"}
            except Exception as err:  # the driver raises it with the class name
                reply = {"error": f"{type(err).__name__}: {err}"}
            replies.write(json.dumps(reply) + "\n")
    finally:
        decode.close()
        prefill.close()
