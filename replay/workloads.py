"""The workloads format (``workloads/README.md``): real public prompts by slice, as OpenAI chat requests.
``specgate trace build``, the benchmarks and the tests read the sample shipped in ``workloads/`` unless
``--workloads DIR`` or ``$SPECGATE_WORKLOADS`` names a full copy of the sets (same layout).

Slices follow the workloads README: HumanEval and Spec-Bench ``coding`` are ``code``; BFCL is
``tool_call`` (schemas converted to OpenAI tools as BFCL does: its type names mapped by
``GORILLA_TO_OPENAPI``, ``.`` replaced by ``_`` in names); Spec-Bench ``summarization``/``rag`` and QMSum
are ``long_context``; everything else in Spec-Bench is ``prose``. ``code_edit`` is ours and recorded as
such: a HumanEval prompt wrapped in an instruction to rewrite it (high n-gram overlap by design).

Long prompts are cut to ``max_chars`` by keeping the head and the tail (LongBench's middle truncation);
every cut is recorded on the item (``truncated_from``).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from workloads import default_dir

SLICES = ("code", "tool_call", "prose", "long_context", "code_edit")

# bfcl_eval/constants/type_mappings.py GORILLA_TO_OPENAPI (upstream), for the types that occur here
GORILLA_TO_OPENAPI = {
    "integer": "integer", "number": "number", "float": "number", "string": "string", "boolean": "boolean",
    "bool": "boolean", "array": "array", "list": "array", "dict": "object", "object": "object",
    "tuple": "array", "any": "string", "byte": "integer", "short": "integer", "long": "integer",
    "double": "number", "char": "string", "ArrayList": "array", "Array": "array", "HashMap": "object",
    "Hashtable": "object", "Queue": "array", "Stack": "array", "String": "string", "int": "integer",
    "Boolean": "boolean", "Integer": "integer", "Long": "integer", "Double": "number", "Float": "number",
    "Any": "string", "Set": "array", "LinkedList": "array", "Object": "object", "Map": "object",
}


@dataclass(frozen=True)
class WorkItem:
    id: str
    slice: str
    messages: list[dict]
    tools: list[dict] | None = None
    source: str = ""
    truncated_from: int | None = None  # original prompt chars when cut to max_chars
    meta: dict = field(default_factory=dict)

    def chat_body(self) -> dict:
        """The item as a chat request body: its messages, and its ``tools`` when it has some."""
        return {"messages": self.messages, **({"tools": self.tools} if self.tools else {})}


def _convert_schema(node: object) -> object:
    if isinstance(node, dict):
        out = {k: _convert_schema(v) for k, v in node.items()}
        if isinstance(node.get("type"), str):
            out["type"] = GORILLA_TO_OPENAPI.get(node["type"], "string")
        return out
    if isinstance(node, list):
        return [_convert_schema(v) for v in node]
    return node


def bfcl_tools(functions: list[dict]) -> list[dict]:
    """BFCL function docs -> OpenAI ``tools`` (bfcl_eval/model_handler/utils.py:convert_to_tool)."""
    return [{"type": "function", "function": {
        "name": f["name"].replace(".", "_"),
        "description": f.get("description", ""),
        "parameters": _convert_schema(f.get("parameters", {"type": "dict", "properties": {}})),
    }} for f in functions]


def truncate_middle(text: str, max_chars: int) -> tuple[str, int | None]:
    if len(text) <= max_chars:
        return text, None
    half = max_chars // 2
    return text[:half] + "\n...\n" + text[-half:], len(text)


def _jsonl(path: Path) -> list[dict]:
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def load_all(root: Path | str | None = None, max_chars: int = 6000) -> dict[str, list[WorkItem]]:
    """Every item of every set under ``root`` (default: ``workloads.default_dir()``), by slice."""
    root = Path(root) if root is not None else default_dir()
    if not (root / "humaneval" / "HumanEval.jsonl").is_file():
        raise FileNotFoundError(f"--workloads {root}: not a workloads directory (no humaneval/HumanEval.jsonl); "
                                "pass a full copy of the sets, or leave it out for the sample in workloads/")
    out: dict[str, list[WorkItem]] = {s: [] for s in SLICES}
    for row in _jsonl(root / "humaneval" / "HumanEval.jsonl"):
        code = row["prompt"]
        out["code"].append(WorkItem(
            id=row["task_id"], slice="code", source="humaneval",
            messages=_user(f"Complete the following Python function.\n\n```python\n{code}```")))
        out["code_edit"].append(WorkItem(
            id=row["task_id"] + "/edit", slice="code_edit", source="humaneval (rewrite instruction is ours)",
            messages=_user("Rewrite the following Python code: rename the function to `solution` and keep "
                           f"everything else exactly the same.\n\n```python\n{code}```")))
    for row in _jsonl(root / "spec_bench" / "question.jsonl"):
        category = row["category"]
        slice_ = ("code" if category == "coding" else
                  "long_context" if category in ("summarization", "rag") else "prose")
        text, cut = truncate_middle(row["turns"][0], max_chars)
        out[slice_].append(WorkItem(id=f"spec_bench/{row['question_id']}", slice=slice_, messages=_user(text),
                                    source=f"spec_bench/{category}", truncated_from=cut))
    for path in sorted((root / "bfcl").glob("BFCL_v4_*.jsonl")):
        for row in _jsonl(path):
            out["tool_call"].append(WorkItem(
                id=row["id"], slice="tool_call", source=path.stem, messages=row["question"][0],
                tools=bfcl_tools(row["function"])))
    for row in _jsonl(root / "qmsum_longbench" / "qmsum_test_prompts.jsonl"):
        text, cut = truncate_middle(row["prompt"], max_chars)
        out["long_context"].append(WorkItem(id=row["id"], slice="long_context", source="qmsum_longbench",
                                            messages=_user(text), truncated_from=cut))
    return out


def sample(root: Path | str | None, per_slice: int = 8, seed: int = 0, max_chars: int = 6000,
           slices: tuple[str, ...] = SLICES) -> list[WorkItem]:
    """A fixed, seeded sample per slice (the same requests for every arm of a benchmark). Every slice is
    drawn, in ``SLICES`` order, whatever ``slices`` selects, so a slice's requests do not depend on which
    other slices a run serves: a run of a subset serves the same prompts as the run of all slices."""
    unknown = [s for s in slices if s not in SLICES]
    if unknown:
        raise ValueError(f"slices: unknown {unknown}; choose from {list(SLICES)}")
    items = load_all(root, max_chars)
    rng = random.Random(seed)
    drawn = {s: rng.sample(items[s], min(per_slice, len(items[s]))) for s in SLICES}
    return [item for s in slices for item in drawn[s]]
