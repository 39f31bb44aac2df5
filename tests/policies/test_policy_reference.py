"""docs/policy.md's key reference is generated from the schema (policies/reference.py): every key has a meaning,
the page's block is what the schema gives now, and the page's complete example is a valid policy."""

from __future__ import annotations

import re
from pathlib import Path

from policies import reference
from policies.load import load_policy

PAGE = Path(__file__).resolve().parents[2] / "docs" / "policy.md"


def test_every_key_the_reference_shows_has_a_meaning_and_no_meaning_is_left_over() -> None:
    shown = set(reference.rows())
    assert sorted(shown - set(reference.MEANINGS)) == [], "add these keys to policies/reference.py MEANINGS"
    assert sorted(set(reference.MEANINGS) - shown) == [], "these MEANINGS name no key of the schema"


def test_the_page_holds_the_reference_the_schema_gives_now() -> None:
    page = PAGE.read_text(encoding="utf-8")
    assert reference.splice(page, reference.render()) == page, \
        "docs/policy.md's policy reference is stale: run python -m policies.reference"


def test_types_bounds_and_defaults_come_from_the_schema() -> None:
    block = reference.render()
    assert "| `half_life_s` | number > 0 | `600` | statistics lose half their weight every half-life |" in block
    assert "| `concurrency_buckets` | list (>= 1) of int >= 1 | `[1, 2, 4, 8, 16, 32, 64]` |" in block
    assert "| `pools` | map (>= 1): name -> [Pool](#pools) | required |" in block
    assert "| `draft_tokens` | int 1..64 or `auto` | `auto` |" in block
    assert "| `sampled` | [SampledCheck](#gatesequivalencesampled) | its defaults |" in block
    assert "Every key of [`slices[].when`](#sliceswhen), and:" in block
    headings = re.findall(r"^### (.+)$", block, re.M)
    assert len(headings) == len(reference.schema()["$defs"]) + 1 == len(set(headings))
    assert "| `draft_model` | `layer_truncated`, `model` | free-form |" in block
    assert "| `ngram` | `ngram` | `match`, `max_match_window_size`, `min_match_window_size`, `num_draft_tokens` |" \
        in block


def test_check_fails_on_a_stale_page_and_passes_once_it_is_regenerated(tmp_path: Path, capsys) -> None:
    page = tmp_path / "policy.md"
    page.write_text(f"# a page\n\n{reference.BEGIN}\nold\n{reference.END}\n\nafter\n", encoding="utf-8")
    assert reference.main(["--page", str(page), "--check"]) == 1
    assert "stale" in capsys.readouterr().err
    assert reference.main(["--page", str(page)]) == 0
    assert reference.main(["--page", str(page), "--check"]) == 0
    text = page.read_text(encoding="utf-8")
    assert text.startswith("# a page\n\n" + reference.BEGIN) and text.endswith(reference.END + "\n\nafter\n")


def test_the_complete_example_on_the_page_is_a_valid_policy() -> None:
    page = PAGE.read_text(encoding="utf-8")
    section = page.split("## A complete example", 1)[1]
    example = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    policy = load_policy(example, "policy.md")
    assert [r.name for r in policy.rules][-1] == "learned" and policy.gates is not None
