"""``python generate.py ...`` in a checkout: the same as the console script ``pe-generate`` (src/pe_geometry/cli/generate.py).

    python generate.py ckpt_path=<run>/checkpoints/last.ckpt prompt="ROMEO:" max_new_tokens=200
"""

from pe_geometry.cli.generate import cli

if __name__ == "__main__":
    cli()
