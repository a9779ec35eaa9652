"""A short text sample at the end of training, so every run shows what its model writes."""

from __future__ import annotations

import logging
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_only

from pe_geometry.model import EncoderMLM, LanguageModel
from pe_geometry.model.sampling import fill_masks, generate, prompt_ids
from pe_geometry.settings.training import SampleTextSettings

log = logging.getLogger(__name__)


class SampleTextCallback(L.Callback):
    """At the end of training (rank 0), continue ``prompt`` by ``max_new_tokens`` tokens and log the text.

    A masked-LM encoder cannot continue text: it gets the first ``max_new_tokens`` validation
    tokens with every ``blank_every``-th one masked, and the log shows the blanks it filled.
    The text also goes to every logger that has ``log_text`` (W&B) as ``samples/text``.
    ``context``: "train" draws each token from at most the training length (``seq_len``) of text, as
    ``pe-generate`` does by default; "full" reads the whole text.
    """

    Settings = SampleTextSettings

    def __init__(self, **settings: Any) -> None:
        self.settings = s = self.Settings(**settings)
        self.prompt, self.max_new_tokens, self.blank_every, self.seed = s.prompt, s.max_new_tokens, s.blank_every, s.seed
        self.context = s.context
        self.sampling = {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p}
        self.text: str | None = None  # the last sample, for tests and notebooks

    @rank_zero_only
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        datamodule = getattr(trainer, "datamodule", None)
        tokenizer = getattr(datamodule, "tokenizer", None)
        if tokenizer is None or self.max_new_tokens <= 0:
            return
        model, was_training = pl_module.model, pl_module.training
        if not isinstance(model, LanguageModel):  # a peer (model=xtransformers): generation reads our KV cache
            log.info("no text sample: %s is not one of our models (generation runs through their KV cache)",
                     type(model).__name__)
            return
        model.eval()
        generator = torch.Generator(device=pl_module.device).manual_seed(self.seed)
        context = datamodule.seq_len if self.context == "train" else None
        try:
            if isinstance(model, EncoderMLM):
                self.text = self._fill_in(model, tokenizer, datamodule, pl_module.device, generator, context)
            else:
                ids = prompt_ids(model, tokenizer.encode(self.prompt).ids, tokenizer.token_to_id("<eos>"))
                prompt = torch.tensor([ids], device=pl_module.device)
                out = generate(model, prompt, self.max_new_tokens, generator=generator, context=context, **self.sampling)
                self.text = tokenizer.decode(out[0].tolist())
        except ValueError as err:  # e.g. a learned position table too short: the run itself went fine
            log.warning("no text sample: %s", err)
            return
        finally:
            model.train(was_training)
        log.info("sample after %d steps:\n%s", trainer.global_step, self.text)
        for logger in trainer.loggers:
            if hasattr(logger, "log_text"):
                logger.log_text(key="samples/text", columns=["step", "text"], data=[[trainer.global_step, self.text]])

    def _fill_in(
        self, model: EncoderMLM, tokenizer, datamodule, device: torch.device, generator: torch.Generator, context: int | None
    ) -> str:
        ids = torch.as_tensor(datamodule.streams["validation"][: self.max_new_tokens].astype("int64"), device=device)[None]
        blanked = ids.clone()
        blanked[:, self.blank_every // 2 :: self.blank_every] = model.mask_token_id
        filled = fill_masks(model, blanked, generator=generator, context=context, **self.sampling)
        blanks = (blanked == model.mask_token_id)[0]
        pairs = [f"{tokenizer.decode([int(t)])!r}->{tokenizer.decode([int(f)])!r}" for t, f in zip(ids[0][blanks], filled[0][blanks])]
        return f"{tokenizer.decode(filled[0].tolist())}\n(blanks, true->filled: {', '.join(pairs)})"
