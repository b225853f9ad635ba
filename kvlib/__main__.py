"""``python -m kvlib [question]``: chat with SmolLM2-135M through kvlib's cache, streamed."""

from __future__ import annotations

import argparse
import time

import torch

import kvlib


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kvlib", description=__doc__)
    ap.add_argument("question", nargs="?", default="Explain in two sentences why a KV cache speeds up text generation.")
    ap.add_argument("--max-new-tokens", type=int, default=80)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    model, tok = kvlib.load_smollm2()
    print(f"[loaded SmolLM2-135M-Instruct in {time.perf_counter() - t0:.1f} s]")
    ids = tok.apply_chat_template([{"role": "user", "content": args.question}])
    print(f"user: {args.question}\nassistant: ", end="", flush=True)
    gen = torch.Generator().manual_seed(args.seed)
    out: list[int] = []
    printed = ""
    t0 = time.perf_counter()
    for t in kvlib.stream(model, ids, args.max_new_tokens, temperature=args.temperature, generator=gen, stop=tok.eos_id):
        out.append(t)
        text = tok.decode(out, skip_special_tokens=True)  # decode the whole reply: tokens can split characters
        print(text[len(printed):], end="", flush=True)
        printed = text
    dt = time.perf_counter() - t0
    print(f"\n[{len(out)} tokens in {dt:.2f} s, {len(out) / dt:.1f} tokens/s, prompt of {len(ids)} tokens]")


if __name__ == "__main__":
    main()
