"""`falcon-fwa addition` with both operands written least significant digit first.

    python results/addition/tiny_cpu/operands_lsd_first/run.py --model Falcon-3A.3 --preset tiny \
        --device cpu --threads 1 --no-progress --out /tmp/lsd/Falcon-3A.3

A diagnostic, not a task option: it replaces ``AdditionSample.prompt`` for this process only, so that
``57 + 968`` at width 3 reads ``750+869=5201$`` instead of ``057+968=5201$``; the answer, the loss and the
metrics are unchanged.
"""
import sys

from falcon_fwa.cli import main
from falcon_fwa.tasks.addition import data


def _prompt(self):
    n = self.width
    return f"{self.a:0{n}d}"[::-1] + data.PLUS + f"{self.b:0{n}d}"[::-1] + data.EQUALS


data.AdditionSample.prompt = property(_prompt)

if __name__ == "__main__":
    sys.exit(main(["addition"] + sys.argv[1:]))
