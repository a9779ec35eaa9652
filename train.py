"""``python train.py ...`` in a checkout: the same as the console script ``pe-train`` (src/pe_geometry/cli/train.py).

    python train.py                                  # decoder + sinusoidal PE on Shakespeare
    python train.py model=encoder pe=rope attention=explicit
    python train.py -m pe=sinusoidal,learned,rope,alibi,none seed=0,1,2
"""

from pe_geometry.cli.train import run

if __name__ == "__main__":
    run()
