"""Engine benchmark: transformers generate vs specgate's engine, side by side, same prompts, same dtype.

    .venv/bin/python -m bench.engine --workloads ../shared/workloads --per-slice 3 --max-new-tokens 64 \
        --dtypes float32 bfloat16 --out results/engine.json --markdown docs/engine-bench.md

Arms (greedy, temperature 0, one request at a time):
- ``hf-plain``: ``model.generate``; ``hf-lookup-k``: prompt lookup (``prompt_lookup_num_tokens=k``);
  ``hf-assisted``: assisted generation with the same layer-truncated self-draft our engine uses;
- ``engine-plain``, ``engine-ngram-k`` (k = 2, 4, 8), ``engine-ngram-adaptive`` (k <= 8),
  ``engine-draft-k4`` (layer-truncated self-draft).
Arms are interleaved per prompt (every arm runs prompt i before any runs prompt i+1) so drift on a noisy
machine hits all arms alike. Tokens/s = generated tokens / wall time of the request, summed per slice.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.workloads import DEFAULT_ROOT, SLICES, WorkItem, sample
from backends.engine.config import EngineConfig
from backends.engine.engine import Engine
from backends.engine.model_store import load_prepared
from backends.engine.proposers.draft_model import layer_truncated_draft
from backends.engine.runner import DTYPES, load_model
from backends.engine.types import GenerateRequest, SamplingParams, SpeculationParams

ENGINE_ARMS: dict[str, SpeculationParams] = {
    "engine-plain": SpeculationParams(),
    "engine-ngram-k2": SpeculationParams(proposer="ngram", draft_tokens=2),
    "engine-ngram-k4": SpeculationParams(proposer="ngram", draft_tokens=4),
    "engine-ngram-k8": SpeculationParams(proposer="ngram", draft_tokens=8),
    "engine-ngram-adaptive": SpeculationParams(proposer="ngram", draft_tokens=8, adaptive=True),
    "engine-draft-k4": SpeculationParams(proposer="draft_model", draft_tokens=4),
}
HF_LOOKUP = (2, 4, 8)


@dataclass
class Tally:
    tokens: int = 0
    seconds: float = 0.0
    rounds: int = 0
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def accept_length(self) -> float | None:
        return self.tokens / self.rounds if self.rounds else None


def render(tokenizer, item: WorkItem) -> list[int]:
    messages = item.messages
    if item.tools:  # SmolLM2's template has no tool slot: list the tools in a system message
        tools = json.dumps([t["function"] for t in item.tools])
        messages = [{"role": "system", "content": f"You can call these functions:\n{tools}"}, *messages]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def run_dtype(dtype: str, items: list[WorkItem], max_new: int, draft_layers: int) -> dict:
    prepared = load_prepared()
    model = load_model(str(prepared.path), dtype)
    engine = Engine(EngineConfig(model_path=str(prepared.path), dtype=dtype, draft_layers=draft_layers),
                    model=model)
    tokenizer = engine.tokenizer
    assistant = layer_truncated_draft(model, draft_layers)
    gen_kwargs = dict(max_new_tokens=max_new, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    arms = ["hf-plain", *(f"hf-lookup-k{k}" for k in HF_LOOKUP), "hf-assisted", *ENGINE_ARMS]
    tallies: dict[str, dict[str, Tally]] = {s: {a: Tally() for a in arms} for s in SLICES}
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task(f"{dtype}", total=len(items) * len(arms))
        for n, item in enumerate(items):
            ids = render(tokenizer, item)
            tensor = torch.tensor([ids])
            for arm in arms:
                start = time.perf_counter()
                if arm.startswith("hf-"):
                    extra = {}
                    if arm.startswith("hf-lookup"):
                        extra = {"prompt_lookup_num_tokens": int(arm.rsplit("k", 1)[1])}
                    elif arm == "hf-assisted":
                        extra = {"assistant_model": assistant}
                    with torch.inference_mode():
                        out = model.generate(tensor, attention_mask=torch.ones_like(tensor), **gen_kwargs, **extra)
                    new = out[0, len(ids):].tolist()
                    rounds = 0
                else:
                    result = engine.generate(GenerateRequest(
                        rid=f"{arm}-{n}", input_ids=tuple(ids),
                        sampling=SamplingParams(max_new_tokens=max_new, temperature=0.0),
                        speculation=ENGINE_ARMS[arm]))
                    new, rounds = list(result.output_ids), result.stats.verify_ct
                t = tallies[item.slice][arm]
                t.seconds += time.perf_counter() - start
                t.tokens += len(new)
                t.rounds += rounds
                t.outputs.append(new)
                bar.advance(task)
    engine.shutdown()
    return tallies


def summarise(tallies: dict, slices: tuple[str, ...]) -> dict:
    table = {}
    for s in slices:
        arms = tallies[s]
        base = arms["engine-plain"].tok_s
        ref = arms["engine-plain"].outputs
        table[s] = {a: {
            "tok_s": round(t.tok_s, 2),
            "speedup_vs_engine_plain": round(t.tok_s / base, 3) if base else None,
            "speedup_vs_hf_plain": round(t.tok_s / arms["hf-plain"].tok_s, 3) if arms["hf-plain"].tok_s else None,
            "accept_length": round(t.accept_length, 2) if t.accept_length else None,
            "tokens": t.tokens,
            "identical_to_engine_plain": sum(o == r for o, r in zip(t.outputs, ref)),
            "prompts": len(t.outputs),
        } for a, t in arms.items()}
    return table


def markdown(results: dict) -> str:
    lines = []
    for dtype, table in results["by_dtype"].items():
        lines.append(f"\n#### {dtype}\n")
        slices = list(table)
        lines.append("| arm | " + " | ".join(f"{s} tok/s (x plain, acc len)" for s in slices) + " |")
        lines.append("|---|" + "---|" * len(slices))
        for arm in next(iter(table.values())):
            cells = []
            for s in slices:
                r = table[s][arm]
                acc = f", {r['accept_length']}" if r["accept_length"] else ""
                same = "" if r["identical_to_engine_plain"] == r["prompts"] else \
                    f", {r['identical_to_engine_plain']}/{r['prompts']} identical"
                cells.append(f"{r['tok_s']:.1f} ({r['speedup_vs_engine_plain']:.2f}x{acc}{same})")
            lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", type=Path, default=DEFAULT_ROOT)
    parser.add_argument("--per-slice", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-chars", type=int, default=3000, help="truncate long prompts (middle)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=list(DTYPES))
    parser.add_argument("--draft-layers", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None, help="write the tables to this file")
    args = parser.parse_args(argv)
    items = sample(args.workloads, args.per_slice, args.seed, args.max_chars)
    import transformers

    header = {
        "command": "python -m bench.engine " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": _cpu_model(), "threads": torch.get_num_threads(), "python": platform.python_version(),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "prompts": {s: [i.id for i in items if i.slice == s] for s in SLICES},
        "max_new_tokens": args.max_new_tokens,
    }
    print(json.dumps(header, indent=1))
    results = {**header, "by_dtype": {}}
    for dtype in args.dtypes:
        results["by_dtype"][dtype] = summarise(run_dtype(dtype, items, args.max_new_tokens, args.draft_layers),
                                               SLICES)
    text = markdown(results)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))
    if args.markdown:
        args.markdown.write_text(f"Command: `{header['command']}`\n\n{text}")
    return 0


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    sys.exit(main())
