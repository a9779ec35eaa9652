"""A short text sample at the end of training, so every run shows what its model writes."""

from __future__ import annotations

import logging
from typing import Annotated, Literal

import lightning as L
import torch
from annotated_types import Ge, Interval
from lightning.pytorch.utilities import rank_zero_only

from pe_geometry.model import EncoderMLM, LanguageModel
from pe_geometry.model.sampling import fill_masks, generate, prompt_ids
from pe_geometry.signatures import MAX_SEED

log = logging.getLogger(__name__)


class SampleTextCallback(L.Callback):
    """At the end of training (rank 0), continue ``prompt`` by ``max_new_tokens`` tokens and log the text.

    A masked-LM encoder cannot continue text: it gets the first ``max_new_tokens`` validation
    tokens with every ``blank_every``-th one masked, and the log shows the blanks it filled.
    The text also goes to every logger that has ``log_text`` (W&B) as ``samples/text``.
    ``context``: "train" draws each token from at most the training length (``seq_len``) of text, as
    ``pe-generate`` does by default; "full" reads the whole text.
    """

    def __init__(
        self,
        prompt: str = "ROMEO:\n",
        max_new_tokens: Annotated[int, Ge(0), "0: no sample"] = 48,
        temperature: Annotated[float, Ge(0), "0: greedy"] = 0.8,
        top_k: Annotated[int | None, Ge(0), "0 or null: off"] = 40,
        top_p: Annotated[float | None, Interval(gt=0, le=1), "1 or null: off"] = 0.95,
        blank_every: Annotated[int, Ge(1)] = 6,
        seed: Annotated[int, Interval(ge=0, le=MAX_SEED)] = 0,
        context: Literal["train", "full"] = "train",
    ) -> None:
        if context not in ("train", "full"):
            raise ValueError(f"callbacks.sample.context={context!r}; valid: ['train', 'full']")
        self.context = context
        self.prompt, self.max_new_tokens, self.blank_every, self.seed = prompt, max_new_tokens, blank_every, seed
        self.sampling = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
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
