"""Drafter configuration in DeepSpec's `config.json` format.

A DeepSpec draft checkpoint's `config.json` is the target's Qwen3 config plus DeepSpec's own keys
(`architectures`, `block_size`, `target_layer_ids`, `num_target_layers`, `mask_token_id`, `markov_rank`,
`markov_head_type`, `enable_confidence_head`, `confidence_head_with_markov`; Eagle3: `ttt_length`,
`step_loss_decay`, `draft_num_hidden_layers`). `num_hidden_layers` there is the *draft* depth.

This module reads such a file into a frozen, validated `DrafterConfig` and writes it back in the same
format; keys it does not model (`layer_types`, `model_type`, `transformers_version`, ...) ride along
untouched in `extra`. It also reads the optional STS calibration (per-slot confidence temperatures,
algorithms.md section 6), either as a `calibration` block of `config.json` or as a sidecar
`calibration.json` (the sidecar wins, so a calibration run never has to rewrite the checkpoint):

    {"method": "sts", "temperatures": [t_1, ..., t_gamma], "greedy": {"temperatures": [...]}}

Our extensions: the optional `greedy` section calibrates the greedy confidence output, and method
"platt" adds a bias per slot beside each temperature (`"biases": [b_1, ..., b_gamma]`, at the top level
and in `greedy`), c_k = sigmoid(logit_k / t_k + b_k); missing biases are 0. An optional
`"request_history": {"weights": [w_1, ..., w_gamma], "strength": s, "prior": m}` (top level and in `greedy`)
adds the request's own offset (dspark_core.calibration.RequestHistory), applied by the engine.

It knows nothing about weights, tensors or devices.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from dspark_core.calibration import RequestHistory
from dspark_core.errors import InvalidArgument, ModelLoadError

ARCH_DSPARK = "Qwen3DSparkModel"
ARCH_EAGLE3 = "Qwen3Eagle3Model"
ARCHITECTURES = (ARCH_DSPARK, ARCH_EAGLE3)
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
CONFIG_FILE = "config.json"
CALIBRATION_FILE = "calibration.json"
MAX_BLOCK_SIZE = 64
_KEEP = object()  # with_calibration: leave the greedy calibration as it is
CALIBRATION_METHODS = ("sts", "platt")

# Keys of config.json that DrafterConfig owns; everything else is kept verbatim in `extra`.
_OWNED_KEYS = frozenset({
    "architectures", "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
    "num_key_value_heads", "head_dim", "num_hidden_layers", "target_layer_ids", "num_target_layers",
    "rms_norm_eps", "max_position_embeddings", "attention_bias", "hidden_act", "tie_word_embeddings",
    "block_size", "mask_token_id", "num_anchors", "markov_rank", "markov_head_type",
    "enable_confidence_head", "confidence_head_with_markov", "greedy_confidence_head", "ttt_length", "step_loss_decay",
    "draft_num_hidden_layers", "calibration", "draft_vocab_size", "target_tensors", "draft_support_size",
    "context_feature_dtype",
})
# dtypes a drafter's context features may be rounded to (`context_feature_dtype`)
CONTEXT_FEATURE_DTYPES = ("bfloat16", "float16", "float32")
# `target_tensors` value of a checkpoint that stores only its own tensors and takes `embed_tokens.weight` and
# `lm_head.weight` (its rows `draft_vocab_ids` with a draft vocabulary) from the target it runs beside
TARGET_TENSORS_REFERENCED = "referenced"


def _require_int(name: str, value: object, low: int | None = None, high: int | None = None) -> None:
    if value is None:
        raise InvalidArgument(name, value, "is required")
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidArgument(name, value, "must be an integer")
    if low is not None and value < low:
        raise InvalidArgument(name, value, f"must be >= {low}")
    if high is not None and value > high:
        raise InvalidArgument(name, value, f"must be <= {high}")


def _require_finite_float(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidArgument(name, value, "must be a finite number")


def _require_positive_float(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise InvalidArgument(name, value, "must be a finite number > 0")


@dataclass(frozen=True)
class DrafterConfig:
    """Everything needed to build a DSpark / DFlash / Eagle3 drafter (no weights)."""

    architecture: str  # "Qwen3DSparkModel" | "Qwen3Eagle3Model"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_hidden_layers: int  # draft depth
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    # DSpark / DFlash
    block_size: int | None = None
    mask_token_id: int | None = None
    num_anchors: int | None = None  # training only
    markov_rank: int = 0
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = True
    # our extension (DeepSpec checkpoints lack it): a second confidence output, trained on the greedy label
    # 1[argmax draft == argmax target], used for temperature-0 requests (`confidence_head.greedy`)
    greedy_confidence_head: bool = False
    # our extension: the drafter predicts only these many target ids (`draft_vocab_ids`, a sorted int64
    # buffer in the weights): its LM head / Markov output rows are the target's rows of those ids; 0 = all
    draft_vocab_size: int = 0
    # our extension: the top-k support sampled drafts are drawn from when serving this drafter (measured per drafter:
    # `dspark eval --support-size K`); 0 = drafters.base.DEFAULT_SUPPORT_SIZE. Any k is lossless (the verifier reads q
    # on the support); a smaller one is cheaper to draw, to send and to check, and costs the draft mass it cuts
    draft_support_size: int = 0
    # our extension: TARGET_TENSORS_REFERENCED = embedding and LM head are not in the file but the target's
    target_tensors: str | None = None
    # our extension: the precision of the target features it was trained on (the training cache's dtype; `dspark
    # train` records it). Its context features are rounded to it before use, so a float32 target's features reach it
    # as in training, and a verifier pod may send them in it (half the bytes of float32) with the same drafts as
    # the embedded engine. None = used as they come
    context_feature_dtype: str | None = None
    # Eagle3
    ttt_length: int | None = None
    step_loss_decay: float | None = None
    draft_num_hidden_layers: int | None = None
    # STS calibration: one temperature per draft slot, None = all 1.0
    calibration_temperatures: tuple[float, ...] | None = None
    # STS of the greedy confidence output (calibration.json "greedy" section), None = all 1.0
    calibration_temperatures_greedy: tuple[float, ...] | None = None
    # Platt biases beside those temperatures (method "platt"), None = all 0
    calibration_biases: tuple[float, ...] | None = None
    calibration_biases_greedy: tuple[float, ...] | None = None
    # request-history recalibration (dspark_core.calibration.RequestHistory) of each output, None = none
    calibration_history: RequestHistory | None = None
    calibration_history_greedy: RequestHistory | None = None
    # config.json keys this class does not model, written back unchanged
    extra: Mapping[str, object] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise InvalidArgument("architectures", self.architecture, f"must be one of {list(ARCHITECTURES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "num_hidden_layers", "max_position_embeddings"):
            _require_int(name, getattr(self, name), low=1)
        if self.num_attention_heads % self.num_key_value_heads:
            raise InvalidArgument("num_key_value_heads", self.num_key_value_heads,
                                  f"must divide num_attention_heads ({self.num_attention_heads})")
        if self.head_dim % 2:
            raise InvalidArgument("head_dim", self.head_dim, "must be even (rotate-half RoPE)")
        _require_positive_float("rms_norm_eps", self.rms_norm_eps)
        _require_positive_float("rope_theta", self.rope_theta)
        if self.hidden_act != "silu":
            raise InvalidArgument("hidden_act", self.hidden_act, "must be 'silu' (SwiGLU MLP)")
        self._validate_target_layers()
        if self.architecture == ARCH_DSPARK:
            self._validate_dspark()
        else:
            self._validate_eagle3()
        for name, temps in (("calibration.temperatures", self.calibration_temperatures),
                            ("calibration.greedy.temperatures", self.calibration_temperatures_greedy)):
            if temps is None:
                continue
            if not isinstance(temps, tuple) or len(temps) != self.gamma:
                raise InvalidArgument(name, temps, f"must be a tuple of {self.gamma} temperatures (one per draft slot)")
            for t in temps:
                _require_positive_float(name, t)
        for name, biases in (("calibration.biases", self.calibration_biases),
                             ("calibration.greedy.biases", self.calibration_biases_greedy)):
            if biases is None:
                continue
            if not isinstance(biases, tuple) or len(biases) != self.gamma:
                raise InvalidArgument(name, biases, f"must be a tuple of {self.gamma} biases (one per draft slot)")
            for b in biases:
                _require_finite_float(name, b)
        for name, hist in (("calibration.request_history", self.calibration_history),
                           ("calibration.greedy.request_history", self.calibration_history_greedy)):
            if hist is None:
                continue
            if not isinstance(hist, RequestHistory) or len(hist.weights) != self.gamma:
                raise InvalidArgument(f"{name}.weights", getattr(hist, "weights", hist),
                                      f"must be {self.gamma} weights (one per draft slot)")
        _require_int("draft_vocab_size", self.draft_vocab_size, low=0, high=self.vocab_size)
        _require_int("draft_support_size", self.draft_support_size, low=0, high=self.vocab_size)
        if self.context_feature_dtype is not None and self.context_feature_dtype not in CONTEXT_FEATURE_DTYPES:
            raise InvalidArgument("context_feature_dtype", self.context_feature_dtype,
                                  f"must be one of {', '.join(CONTEXT_FEATURE_DTYPES)} or absent")
        if self.target_tensors not in (None, TARGET_TENSORS_REFERENCED):
            raise InvalidArgument("target_tensors", self.target_tensors,
                                  f"must be {TARGET_TENSORS_REFERENCED!r} or absent (the file holds them)")
        if self.greedy_confidence_head and not (self.architecture == ARCH_DSPARK and self.enable_confidence_head):
            raise InvalidArgument("greedy_confidence_head", True, "needs a DSpark drafter with a confidence head")

    def _validate_target_layers(self) -> None:
        ids = self.target_layer_ids
        if not isinstance(ids, tuple) or not ids:
            raise InvalidArgument("target_layer_ids", ids, "must be a non-empty tuple of layer ids")
        for i in ids:
            _require_int("target_layer_ids", i, low=-1)
        if any(b <= a for a, b in zip(ids, ids[1:])):
            raise InvalidArgument("target_layer_ids", list(ids), "must be strictly increasing")
        if self.num_target_layers is not None:
            _require_int("num_target_layers", self.num_target_layers, low=1)
            if ids[-1] >= self.num_target_layers - 1:
                raise InvalidArgument("target_layer_ids", list(ids),
                                      f"must stay below the target's last layer ({self.num_target_layers - 1}): "
                                      "HF returns that one after the final norm")

    def _validate_dspark(self) -> None:
        _require_int("block_size", self.block_size, low=1, high=MAX_BLOCK_SIZE)
        _require_int("mask_token_id", self.mask_token_id, low=0, high=self.vocab_size - 1)
        if self.num_anchors is not None:
            _require_int("num_anchors", self.num_anchors, low=1)
        _require_int("markov_rank", self.markov_rank, low=0)
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise InvalidArgument("markov_head_type", self.markov_head_type, f"must be one of {list(MARKOV_HEAD_TYPES)}")

    def _validate_eagle3(self) -> None:
        _require_int("ttt_length", self.ttt_length, low=1, high=MAX_BLOCK_SIZE)
        if self.num_hidden_layers != 1:
            raise InvalidArgument("num_hidden_layers", self.num_hidden_layers, "must be 1 for Eagle3 (one draft layer)")
        if self.draft_num_hidden_layers not in (None, 1):
            raise InvalidArgument("draft_num_hidden_layers", self.draft_num_hidden_layers, "must be 1 for Eagle3")
        if self.step_loss_decay is not None:
            _require_positive_float("step_loss_decay", self.step_loss_decay)

    # ---- derived values -------------------------------------------------------------------------

    @property
    def kind(self) -> str:
        """'eagle3', 'dflash' (no Markov head, no confidence head) or 'dspark'."""
        if self.architecture == ARCH_EAGLE3:
            return "eagle3"
        if self.markov_rank == 0 and not self.enable_confidence_head:
            return "dflash"
        return "dspark"

    @property
    def gamma(self) -> int:
        """Draft tokens per round: block_size (DSpark/DFlash) or ttt_length (Eagle3)."""
        return self.ttt_length if self.architecture == ARCH_EAGLE3 else self.block_size

    @property
    def feature_size(self) -> int:
        """Width of one position's concatenated target features, L * H."""
        return len(self.target_layer_ids) * self.hidden_size

    @property
    def sts_temperatures(self) -> tuple[float, ...]:
        return self.calibration_temperatures or (1.0,) * self.gamma

    @property
    def sts_temperatures_greedy(self) -> tuple[float, ...]:
        """Temperatures of the greedy confidence output (all 1.0 until `dspark calibrate --temperature 0`)."""
        return self.calibration_temperatures_greedy or (1.0,) * self.gamma

    @property
    def calibration_bias_values(self) -> tuple[float, ...]:
        """Platt biases of the (sampled) confidence head, all 0 under STS."""
        return self.calibration_biases or (0.0,) * self.gamma

    @property
    def calibration_bias_values_greedy(self) -> tuple[float, ...]:
        return self.calibration_biases_greedy or (0.0,) * self.gamma

    @property
    def output_size(self) -> int:
        """Logits per slot: the draft vocabulary's size, or the whole vocabulary without one."""
        return self.draft_vocab_size or self.vocab_size

    @property
    def confidence_input_size(self) -> int:
        with_markov = self.confidence_head_with_markov and self.markov_rank > 0
        return self.hidden_size + (self.markov_rank if with_markov else 0)

    def with_calibration(self, temperatures, greedy=_KEEP, *, biases=None, greedy_biases=_KEEP, history=None,
                         greedy_history=_KEEP) -> DrafterConfig:
        """Install a calibration: `temperatures` (and Platt `biases`, None = all 0; a `history`, None = none)
        for the (sampled) confidence head and, if given, `greedy` / `greedy_biases` / `greedy_history` for the
        greedy output (default: keep the current ones); temperatures None = all 1.0."""
        def tup(x):
            return None if x is None else tuple(float(v) for v in x)

        if greedy is _KEEP:
            greedy = self.calibration_temperatures_greedy
            if greedy_biases is _KEEP:
                greedy_biases = self.calibration_biases_greedy
            if greedy_history is _KEEP:
                greedy_history = self.calibration_history_greedy
        else:
            if greedy_biases is _KEEP:
                greedy_biases = None
            if greedy_history is _KEEP:
                greedy_history = None
        return dataclasses.replace(self, calibration_temperatures=tup(temperatures),
                                   calibration_temperatures_greedy=tup(greedy), calibration_biases=tup(biases),
                                   calibration_biases_greedy=tup(greedy_biases), calibration_history=history,
                                   calibration_history_greedy=greedy_history)

    def confidence_history(self, greedy: bool) -> RequestHistory | None:
        """The request history of the greedy output (`greedy`) or of the sampled head; None = none."""
        return self.calibration_history_greedy if greedy else self.calibration_history

    # ---- config.json ----------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> DrafterConfig:
        """Parse a DeepSpec config.json dict; raises InvalidArgument for a bad or missing value."""
        def need(key):
            if d.get(key) is None:
                raise InvalidArgument(key, None, "is required in config.json")
            return d[key]

        archs = need("architectures")
        if not isinstance(archs, list) or len(archs) != 1:
            raise InvalidArgument("architectures", archs, "must be a list with exactly one architecture")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if not isinstance(rope, Mapping):
            raise InvalidArgument("rope_parameters", rope, "must be an object")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise InvalidArgument("rope_parameters.rope_type", rope_type,
                                  "must be 'default' (RoPE scaling variants are not implemented)")
        if d.get("use_sliding_window"):
            raise InvalidArgument("use_sliding_window", d["use_sliding_window"], "must be false")
        heads = need("num_attention_heads")
        hidden = need("hidden_size")
        head_dim = d.get("head_dim")
        if head_dim is None and isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
            head_dim = hidden // heads
        ids = need("target_layer_ids")
        if not isinstance(ids, list):
            raise InvalidArgument("target_layer_ids", ids, "must be a list of layer ids")
        calib = d.get("calibration")
        kwargs = dict(
            architecture=archs[0],
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            num_hidden_layers=need("num_hidden_layers"),
            target_layer_ids=tuple(ids),
            num_target_layers=d.get("num_target_layers"),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", d.get("rope_theta", 10000.0)),
            max_position_embeddings=d.get("max_position_embeddings", 32768),
            attention_bias=bool(d.get("attention_bias", False)),
            hidden_act=d.get("hidden_act", "silu"),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            block_size=d.get("block_size"),
            mask_token_id=d.get("mask_token_id"),
            num_anchors=d.get("num_anchors"),
            markov_rank=d.get("markov_rank", 0),
            markov_head_type=d.get("markov_head_type", "vanilla"),
            enable_confidence_head=bool(d.get("enable_confidence_head", False)),
            confidence_head_with_markov=bool(d.get("confidence_head_with_markov", True)),
            greedy_confidence_head=bool(d.get("greedy_confidence_head", False)),
            ttt_length=d.get("ttt_length"),
            step_loss_decay=d.get("step_loss_decay"),
            draft_num_hidden_layers=d.get("draft_num_hidden_layers"),
            draft_vocab_size=d.get("draft_vocab_size", 0),
            draft_support_size=d.get("draft_support_size", 0),
            target_tensors=d.get("target_tensors"),
            context_feature_dtype=d.get("context_feature_dtype"),
            calibration_temperatures=None if calib is None else parse_calibration(calib),
            calibration_temperatures_greedy=None if calib is None else parse_greedy_calibration(calib),
            calibration_biases=None if calib is None else parse_calibration_biases(calib),
            calibration_biases_greedy=None if calib is None else parse_calibration_biases(calib, greedy=True),
            calibration_history=None if calib is None else parse_calibration_history(calib),
            calibration_history_greedy=None if calib is None else parse_calibration_history(calib, greedy=True),
            extra={k: v for k, v in d.items() if k not in _OWNED_KEYS},
        )
        return cls(**kwargs)

    def to_dict(self) -> dict[str, object]:
        """The config.json dict, DeepSpec layout (unmodelled keys from `extra` included)."""
        d: dict[str, object] = dict(self.extra)
        d.update(
            architectures=[self.architecture], vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            num_hidden_layers=self.num_hidden_layers, target_layer_ids=list(self.target_layer_ids),
            rms_norm_eps=self.rms_norm_eps, max_position_embeddings=self.max_position_embeddings,
            attention_bias=self.attention_bias, hidden_act=self.hidden_act,
            tie_word_embeddings=self.tie_word_embeddings,
        )
        # RoPE: keep whichever spelling the file used (transformers 5 `rope_parameters` or 4.x `rope_theta`).
        if isinstance(d.get("rope_parameters"), Mapping):
            d["rope_parameters"] = {**d["rope_parameters"], "rope_theta": self.rope_theta}
        elif "rope_theta" in d:
            d["rope_theta"] = self.rope_theta
        else:
            d["rope_parameters"] = {"rope_theta": self.rope_theta, "rope_type": "default"}
        optional = {"num_target_layers": self.num_target_layers}
        if self.architecture == ARCH_DSPARK:
            optional.update(block_size=self.block_size, mask_token_id=self.mask_token_id,
                            num_anchors=self.num_anchors, markov_rank=self.markov_rank,
                            enable_confidence_head=self.enable_confidence_head)
            if self.markov_rank > 0:
                optional["markov_head_type"] = self.markov_head_type
            if self.enable_confidence_head:
                optional["confidence_head_with_markov"] = self.confidence_head_with_markov
            if self.greedy_confidence_head:
                optional["greedy_confidence_head"] = True
        else:
            optional.update(ttt_length=self.ttt_length, step_loss_decay=self.step_loss_decay,
                            draft_num_hidden_layers=self.draft_num_hidden_layers)
        if self.draft_vocab_size:
            optional["draft_vocab_size"] = self.draft_vocab_size
        if self.draft_support_size:
            optional["draft_support_size"] = self.draft_support_size
        if self.target_tensors:
            optional["target_tensors"] = self.target_tensors
        if self.context_feature_dtype:
            optional["context_feature_dtype"] = self.context_feature_dtype
        if self.calibration_temperatures is not None:
            block = {"method": "platt" if self.calibration_biases else "sts",
                     "temperatures": list(self.calibration_temperatures)}
            if self.calibration_biases:
                block["biases"] = list(self.calibration_biases)
            if self.calibration_history is not None:
                block["request_history"] = self.calibration_history.to_dict()
            if self.calibration_temperatures_greedy is not None:
                block["greedy"] = {"temperatures": list(self.calibration_temperatures_greedy)}
                if self.calibration_biases_greedy:
                    block["greedy"].update(method="platt", biases=list(self.calibration_biases_greedy))
                if self.calibration_history_greedy is not None:
                    block["greedy"]["request_history"] = self.calibration_history_greedy.to_dict()
            optional["calibration"] = block
        d.update({k: v for k, v in optional.items() if v is not None})
        return d


def parse_calibration(block: object) -> tuple[float, ...]:
    """Calibration temperatures from a `{"method": "sts" | "platt", "temperatures": [...]}` block."""
    if not isinstance(block, Mapping):
        raise InvalidArgument("calibration", block, 'must be an object {"method": "sts", "temperatures": [...]}')
    method = block.get("method", "sts")
    if method not in CALIBRATION_METHODS:
        raise InvalidArgument("calibration.method", method, f"must be one of {list(CALIBRATION_METHODS)}")
    return _temperature_list("calibration.temperatures", block.get("temperatures"))


def parse_calibration_biases(block: Mapping, greedy: bool = False) -> tuple[float, ...] | None:
    """The optional Platt `"biases"` of a calibration block (or of its `greedy` section); None when absent.
    They must match the temperatures' length."""
    name = "calibration.greedy" if greedy else "calibration"
    section = block.get("greedy") if greedy else block
    if not isinstance(section, Mapping) or section.get("biases") is None:
        return None
    biases, temps = section["biases"], section.get("temperatures")
    if not isinstance(biases, list) or not biases:
        raise InvalidArgument(f"{name}.biases", biases, "must be a non-empty list of numbers")
    for b in biases:
        _require_finite_float(f"{name}.biases", b)
    if isinstance(temps, list) and len(temps) != len(biases):
        raise InvalidArgument(f"{name}.biases", len(biases), f"must have one bias per temperature ({len(temps)})")
    return tuple(float(b) for b in biases)


def parse_calibration_history(block: Mapping, greedy: bool = False) -> RequestHistory | None:
    """The optional `"request_history"` of a calibration block (or of its `greedy` section); None when absent.
    Its weights must match the temperatures' length."""
    name = "calibration.greedy" if greedy else "calibration"
    section = block.get("greedy") if greedy else block
    if not isinstance(section, Mapping) or section.get("request_history") is None:
        return None
    hist = RequestHistory.from_dict(section["request_history"], f"{name}.request_history")
    temps = section.get("temperatures")
    if isinstance(temps, list) and len(temps) != len(hist.weights):
        raise InvalidArgument(f"{name}.request_history.weights", len(hist.weights),
                              f"must have one weight per temperature ({len(temps)})")
    return hist


def _temperature_list(name: str, temps: object) -> tuple[float, ...]:
    if not isinstance(temps, list) or not temps:
        raise InvalidArgument(name, temps, "must be a non-empty list of numbers")
    for t in temps:
        _require_positive_float(name, t)
    return tuple(float(t) for t in temps)


def parse_greedy_calibration(block: Mapping) -> tuple[float, ...] | None:
    """The optional `"greedy": {"temperatures": [...]}` section of a calibration block."""
    greedy = block.get("greedy")
    if greedy is None:
        return None
    return _temperature_list("calibration.greedy.temperatures",
                             greedy.get("temperatures") if isinstance(greedy, Mapping) else None)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: cannot read JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def load_config(path: str | Path, calibration_file: str | Path | None = None) -> DrafterConfig:
    """Read `<path>/config.json` and, if present, the calibration sidecar: `calibration_file` when given
    (a calibration written elsewhere, e.g. for a read-only drafter), else `<path>/calibration.json`."""
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"{path}: drafter checkpoint directory does not exist")
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise ModelLoadError(f"{path}: missing {CONFIG_FILE}")
    data = _read_json(config_path)
    try:
        config = DrafterConfig.from_dict(data)
    except InvalidArgument as exc:
        raise ModelLoadError(f"{config_path}: {exc}") from exc
    calib_path = Path(calibration_file) if calibration_file else path / CALIBRATION_FILE
    if calib_path.is_file():
        try:
            block = _read_json(calib_path)
            config = config.with_calibration(parse_calibration(block), parse_greedy_calibration(block),
                                             biases=parse_calibration_biases(block),
                                             greedy_biases=parse_calibration_biases(block, greedy=True),
                                             history=parse_calibration_history(block),
                                             greedy_history=parse_calibration_history(block, greedy=True))
        except InvalidArgument as exc:
            raise ModelLoadError(f"{calib_path}: {exc}") from exc
    return config


def save_config(config: DrafterConfig, path: str | Path, dtype_name: str | None = None) -> None:
    """Write `<path>/config.json` (sorted keys, like save_pretrained)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    d = config.to_dict()
    if dtype_name is not None:
        d["dtype"] = dtype_name
    (path / CONFIG_FILE).write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")
