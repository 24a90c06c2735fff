"""The models the OpenAI API serves (vLLM's serving_models): the served names, then every loaded LoRA
adapter; the cards /v1/models lists, whether a body's `model` is served, which adapter a body selects, and
the name an answer carries."""

from __future__ import annotations

from pdserve.engine.core.request import Request
from pdserve.engine.sampling_params import InvalidRequestError
from pdserve.services.decode.core import GenerationCore


class ModelNotFound(Exception):
    """A body's `model` that this server does not serve."""


class ServedModels:
    """`names`: what clients call the model (the first is the one answers carry; default: the model's
    name); the adapters are those loaded on `service`'s engine now."""

    def __init__(self, service: GenerationCore, names: tuple[str, ...] = ()):
        self.service = service
        self.names = tuple(names) or (service.engine.model.config.name,)
        self.model = self.names[0]

    def cards(self) -> list[dict]:
        """The served names, then every loaded LoRA adapter (usable as `model`, with the base as parent)."""
        length = self.service.engine.config.max_model_len
        base = {"object": "model", "created": 0, "owned_by": "pdserve", "max_model_len": length}
        cards = [{**base, "id": name, "root": self.model, "parent": None} for name in self.names]
        adapters = self.service.engine.adapter_names()
        return cards + [{**base, "id": name, "root": name, "parent": self.model} for name in adapters]

    def check(self, body: dict) -> None:
        """`model` names a served name or a loaded adapter (omitted or empty: the base model); else
        ModelNotFound."""
        name = body.get("model")
        if name and name not in self.names and name not in self.service.engine.adapter_names():
            raise ModelNotFound(name)

    def adapter(self, body: dict) -> str:
        """`lora_adapter`, else `model` when it names a loaded adapter (vLLM's convention); "": the base."""
        name = body.get("lora_adapter") or ""
        model = body.get("model")
        if not name and isinstance(model, str) and model in self.service.engine.adapter_names():
            name = model
        if not isinstance(name, str):
            raise InvalidRequestError("lora_adapter", "must be a string")
        return name

    def answering(self, request: Request) -> str:
        """The name an answer to `request` carries: its adapter's, else the first served name."""
        return request.lora.name if request.lora else self.model
