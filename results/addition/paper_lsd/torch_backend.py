"""`falcon-fwa addition` with the Falcon layers' op on the PyTorch forms (``backend="torch"``) instead of the
Triton kernels, as the runs ``arms/p5_f3a3_lsd_cur_torch.json`` and ``arms/t2_tiny128_lsd_torch_fp32.json`` were
made (their ``argv`` names this script by its earlier file name, ``torchbk.py``):

    python results/addition/paper_lsd/torch_backend.py --model Falcon-3A.3 --preset paper --device cuda \
        --operand-order lsd --curriculum-steps 1000 --out /tmp/p5
"""
import functools
import sys

import falcon_fwa.layers.falcon_attention as layer
from falcon_fwa.cli import main

layer.falcon_attention = functools.partial(layer.falcon_attention, backend="torch")

if __name__ == "__main__":
    sys.exit(main(["addition"] + sys.argv[1:]))
