"""`moemesh generate`: run prompts through the engine offline and print the text."""

from __future__ import annotations

import argparse
import json
import sys
import time


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate text offline for quick checks")
    p.add_argument("prompts", nargs="+", help="one or more prompts; each is generated on its own")
    p.add_argument("--model", required=True, help="model directory")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message with the chat template")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: off)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed, for reproducible output")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--dtype", default="float32", help="compute dtype: float32, bfloat16 or float16")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="MTP draft tokens per step (default: the model's)")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moemesh.shared.checkpoint.loader import CheckpointError
    from moemesh.shared.engine.config import EngineConfig
    from moemesh.shared.engine.engine import RequestError
    from moemesh.shared.engine.llm import LLM
    from moemesh.shared.protocol.messages import SamplingParamError, SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed, stop=tuple(args.stop))
        cfg = EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                           num_speculative_tokens=args.num_speculative_tokens)
        llm = LLM(cfg)
        prompts = args.prompts
        if args.chat:
            prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        dt = time.perf_counter() - t
    except (CheckpointError, SamplingParamError, RequestError, ValueError) as e:
        print(f"moemesh: error: {e}", file=sys.stderr)
        return 2
    for prompt, o in zip(args.prompts, outs):
        if args.json:
            print(json.dumps({"prompt": prompt, "text": o.text, "token_ids": o.token_ids,
                              "finish_reason": o.finish_reason}, ensure_ascii=False))
        else:
            print(f"--- {prompt!r} ({len(o.token_ids)} tokens, {o.finish_reason})\n{o.text}")
    n = sum(len(o.token_ids) for o in outs)
    print(f"[{n} tokens in {dt:.2f}s]", file=sys.stderr)
    return 0
