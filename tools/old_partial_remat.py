"""The remat the search chose before remat_rest, from a `train --remat auto` log (a device script helper).

Reads the trial lines ("remat none: needs X GiB of B GiB budget", ...) and the choice
("remat auto -> ...") and prints the `--remat P --model remat_layers=k` flags of the
old search (P on the first k blocks, none on the rest, k from the none / P-on-every-
block estimates), or nothing when the choice did not mix two policies.
  python3 tools/old_partial_remat.py LOG LAYERS [+1]
"""

import math
import re
import sys

text = open(sys.argv[1], encoding="utf-8").read()
layers, bump = int(sys.argv[2]), len(sys.argv) > 3
needs = {m[1]: (float(m[2]), float(m[3]))
         for m in re.finditer(r"remat (\w+): needs ([\d.]+) GiB of ([\d.]+) GiB budget", text)}
chosen = re.search(r"remat auto -> (\w+) \(first \d+ blocks, (\w+) on the rest\)", text)
if chosen and "none" in needs and chosen[1] in needs:
    (none, budget), (every, _) = needs["none"], needs[chosen[1]]
    k = max(1, math.ceil((none - budget) / ((none - every) / layers))) + bump
    print(f"--remat {chosen[1]}" + (f" --model remat_layers={k}" if k < layers else ""))
