"""`falcon-fwa addition` with both operands written least significant digit first.

    python results/addition/tiny_cpu/operands_lsd_first/run.py --model Falcon-3A.3 --preset tiny \
        --device cpu --threads 1 --no-progress --out /tmp/lsd/Falcon-3A.3

``57 + 968`` at width 3 reads ``750+869=5201$`` instead of ``057+968=5201$``; the answer, the loss and
the metrics are unchanged. The runs recorded in this folder were made with an earlier version of this
script that replaced ``AdditionSample.prompt`` for its process; it is now equivalent to
``falcon-fwa addition --operand-order lsd ...``.
"""
import sys

from falcon_fwa.cli import main

if __name__ == "__main__":
    sys.exit(main(["addition", "--operand-order", "lsd"] + sys.argv[1:]))
