"""Per load x slice: each policy's ratio over the faster of suffix-k8/suffix-k16 (by ratio), from replay markdown."""
import re, sys
text = open(sys.argv[1]).read()
pols = sys.argv[2:]
rows = {}
for sec in re.split(r"^## ", text, flags=re.M)[1:]:
    head = sec.split("\n", 1)[0].strip()
    r = {}
    for m in re.finditer(r"^\| (\S+) / (\S+) \| ([\d.]+) \|", sec, flags=re.M):
        r[(m.group(1), m.group(2))] = float(m.group(3))
    rows[head] = r
for p in pols:
    print(p)
    for load in ("c1", "c4", "c16", "p0.5"):
        cells = []
        for sl in ("code", "tool_call", "prose", "long_context", "code_edit", "all"):
            r = rows.get(f"{load} / {sl}", {})
            v = [r[(p, a)] for a in ("suffix-k8", "suffix-k16") if (p, a) in r]
            cells.append(f"{sl} {max(v):.3f}" if v else f"{sl} -")
        print(f"  {load}: " + "  ".join(cells))
