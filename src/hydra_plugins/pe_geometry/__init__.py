"""This project's Hydra launchers (configs/hydra/launcher/): Hydra instantiates launchers only from the
``hydra_plugins`` namespace package, which this folder joins when the checkout is on ``sys.path``
(``python train.py`` puts it there)."""
