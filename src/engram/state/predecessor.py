"""Snapshots written by the SGLang-based predecessor (Clarit-AI/Engram), read for import.

Its layout, one pair of files per saved turn:

    <dir>/conversation_<id>/turn_<n>_metadata.json      conversation_id, turn_number, token_count,
                                                         model_name, layer_config {num_layers, ...},
                                                         fill_ids (the token ids), branch_name, ...
    <dir>/conversation_<id>/turn_<n>_state.safetensors  `temporal` [mamba layers, heads, head_dim, d_state]
                                                         `conv_layer_0` [mamba layers, conv_dim, kernel - 1]
    <dir>/conversation_<id>/branches/<name>_metadata.json, <name>_state.safetensors   (named branches)

Only the token ids are imported (the state is recomputed from them); the recorded recurrent state
is mapped onto this engine's tensor names (its conv state is transposed here) to be compared with
the recomputed one. Nothing here follows a link or reads outside `<dir>`.
"""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as load_safetensors

from engram.models.spec import ModelSpec
from engram.state.snapshot import InvalidIdError, read_no_follow, reason_without_paths, validate_id

CONVERSATION_PREFIX = "conversation_"
_TURN_RE = re.compile(r"turn_([0-9]+)_metadata\.json")
_STATE_SUFFIX = "_state.safetensors"
_METADATA_SUFFIX = "_metadata.json"


class RefusedFile(Exception):
    """A predecessor file that cannot be imported; the message says why."""


@dataclass
class PredecessorTurn:
    """One saved turn: where it was found, what it says, and its recurrent state if it kept one."""

    label: str  # its metadata file, relative to the imported folder
    conversation_id: str
    turn_number: int
    branch: str | None  # None: a turn_<n> file of the conversation itself
    fill_ids: list[int]
    state_path: Path | None  # its recorded recurrent state (shapes checked; read by `recorded_state`); None: no state file


@dataclass
class Scan:
    turns: list[PredecessorTurn]
    refused: dict[str, str]  # label -> why


def scan(root: Path, spec: ModelSpec) -> Scan:
    """Every turn file under `root`, read and checked against `spec`, in conversation, branch and
    turn order; what cannot be imported is listed with the reason instead."""
    out = Scan([], {})
    for conv_dir in _entries(root, root, out):
        label = conv_dir.relative_to(root).as_posix()
        if not conv_dir.name.startswith(CONVERSATION_PREFIX):
            out.refused[label] = "not in the predecessor's layout (expected conversation_<id> folders)"
            continue
        if not stat.S_ISDIR(os.lstat(conv_dir).st_mode):
            out.refused[label] = "not a folder"
            continue
        conversation_id = conv_dir.name[len(CONVERSATION_PREFIX) :]
        for path in _entries(root, conv_dir, out):
            if path.name == "branches" and stat.S_ISDIR(os.lstat(path).st_mode):
                for branch_file in _entries(root, path, out):
                    _add(root, branch_file, conversation_id, out, branch=True)
            else:
                _add(root, path, conversation_id, out, branch=False)
    out.turns = [t for t in out.turns if _fits(t, spec, out.refused)]
    out.turns.sort(key=lambda t: (t.conversation_id, t.branch or "", t.turn_number))
    return out


def _entries(root: Path, folder: Path, out: Scan) -> list[Path]:
    """The folder's entries, links refused (never followed)."""
    entries = []
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        path = Path(entry.path)
        if entry.is_symlink():
            out.refused[path.relative_to(root).as_posix()] = "unsafe path: a symbolic link (never followed)"
        else:
            entries.append(path)
    return entries


def _add(root: Path, path: Path, conversation_id: str, out: Scan, branch: bool) -> None:
    label = path.relative_to(root).as_posix()
    if path.name.endswith(_STATE_SUFFIX):
        if not os.path.lexists(path.with_name(path.name[: -len(_STATE_SUFFIX)] + _METADATA_SUFFIX)):
            out.refused[label] = "missing token ids: a state file without its metadata file"
        return  # otherwise read with its metadata
    number = _TURN_RE.fullmatch(path.name)
    if not path.name.endswith(_METADATA_SUFFIX) or (not branch and number is None):
        out.refused[label] = "not in the predecessor's layout (expected turn_<n>_metadata.json and turn_<n>_state.safetensors)"
        return
    try:
        out.turns.append(_read(root, path, conversation_id, branch))
    except RefusedFile as e:
        out.refused[label] = str(e)


def _read(root: Path, metadata_path: Path, conversation_id: str, branch: bool) -> PredecessorTurn:
    label = metadata_path.relative_to(root).as_posix()
    try:
        meta = json.loads(read_no_follow(metadata_path))
    except (OSError, ValueError) as e:
        raise RefusedFile(f"corrupt file: the metadata is not readable JSON ({reason_without_paths(e)})") from e
    if not isinstance(meta, dict):
        raise RefusedFile("corrupt file: the metadata is not a JSON object")
    try:
        validate_id(conversation_id, "conversation_id")
    except InvalidIdError as e:
        raise RefusedFile(f"unsafe path: the folder's conversation id {conversation_id!r} is not one this engine accepts ({e})") from e
    if meta.get("conversation_id") != conversation_id:
        raise RefusedFile(f"corrupt file: it names conversation {meta.get('conversation_id')!r}, its folder {conversation_id!r}")
    turn_number = meta.get("turn_number")
    if not isinstance(turn_number, int) or isinstance(turn_number, bool) or turn_number < 0:
        raise RefusedFile(f"corrupt file: turn_number is {turn_number!r}, not a whole number")
    branch_name = None
    if branch:
        branch_name = metadata_path.name[: -len(_METADATA_SUFFIX)]
        if meta.get("branch_name") != branch_name:
            raise RefusedFile(f"corrupt file: it names branch {meta.get('branch_name')!r}, its file name {branch_name!r}")
        try:
            validate_id(branch_name, "branch")
        except InvalidIdError as e:
            raise RefusedFile(f"unsafe path: {e}") from e
    elif f"turn_{turn_number}_metadata.json" != metadata_path.name:
        raise RefusedFile(f"corrupt file: it records turn_number {turn_number}, its file name another")
    fill_ids = meta.get("fill_ids")
    if not fill_ids:
        raise RefusedFile("missing token ids: the metadata has no fill_ids, so its state cannot be recomputed")
    if not isinstance(fill_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in fill_ids):
        raise RefusedFile("corrupt file: fill_ids is not a list of token ids")
    state_path = metadata_path.with_name(metadata_path.name[: -len(_METADATA_SUFFIX)] + _STATE_SUFFIX)
    return PredecessorTurn(label, conversation_id, turn_number, branch_name, fill_ids, state_path if os.path.lexists(state_path) else None)


def _unreadable(e: Exception) -> RefusedFile:
    return RefusedFile(f"corrupt file: the state file is not readable safetensors ({reason_without_paths(e)})")


def _state_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """The tensors' shapes, from the header alone (each file is read whole only when it is imported)."""
    if stat.S_ISLNK(os.lstat(path).st_mode):
        raise RefusedFile("unsafe path: its state file is a symbolic link (never followed)")
    try:
        with safe_open(str(path), framework="pt") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except (OSError, SafetensorError, ValueError) as e:
        raise _unreadable(e) from e


def _fits(turn: PredecessorTurn, spec: ModelSpec, refused: dict[str, str]) -> bool:
    """Whether the turn fits this model (if not, the reason is noted)."""
    try:
        out_of_vocab = [t for t in turn.fill_ids if not 0 <= t < spec.vocab_size]
        if out_of_vocab:
            raise RefusedFile(f"wrong model: token id {out_of_vocab[0]} is outside this model's vocabulary of {spec.vocab_size}")
        if turn.state_path is not None:
            _check_shapes(_state_shapes(turn.state_path), spec)
    except RefusedFile as e:
        refused[turn.label] = str(e)
        return False
    return True


def _check_shapes(shapes: dict[str, tuple[int, ...]], spec: ModelSpec) -> None:
    """Refuse unless the file holds `temporal` and `conv_layer_0` of this model's shapes."""
    if spec.mamba is None:
        raise RefusedFile("wrong model: this model has no Mamba2 layers, the file holds Mamba2 state")
    layers = spec.mamba_layers
    temporal_shape = (len(layers), *spec.mamba.ssm_state_shape)
    kernel_rows, conv_dim = spec.mamba.conv_state_shape
    conv_shape = (len(layers), conv_dim, kernel_rows)
    convs = sorted(k for k in shapes if k.startswith("conv_layer_"))
    if "temporal" not in shapes or convs != ["conv_layer_0"]:
        raise RefusedFile(f"wrong model/shape: the state file holds {sorted(shapes)}, expected temporal and conv_layer_0")
    for name, expected in (("temporal", temporal_shape), ("conv_layer_0", conv_shape)):
        if shapes[name] != expected:
            raise RefusedFile(f"wrong model/shape: {name} has shape {shapes[name]}, this model's is {expected}")


def recorded_state(turn: PredecessorTurn, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The turn's recorded `temporal` and `conv_layer_0` as `layers.<i>.ssm` / `layers.<i>.conv`
    (float32), read whole and checked again (the file may have changed since the scan)."""
    assert turn.state_path is not None and spec.mamba is not None
    try:
        tensors = load_safetensors(bytes(read_no_follow(turn.state_path)))
    except (OSError, SafetensorError, ValueError) as e:
        raise _unreadable(e) from e
    _check_shapes({name: tuple(t.shape) for name, t in tensors.items()}, spec)
    out = {}
    for row, layer in enumerate(spec.mamba_layers):
        out[f"layers.{layer}.ssm"] = tensors["temporal"][row].float()
        out[f"layers.{layer}.conv"] = tensors["conv_layer_0"][row].float().T.contiguous()
    return out


@dataclass(frozen=True)
class Difference:
    max_abs: float  # the largest |recorded - recomputed| over every recurrent tensor
    max_rel: float  # each tensor's largest difference over its largest magnitude, the worst tensor's

    def within(self, tolerance: float) -> bool:
        return self.max_rel <= tolerance


def difference(recorded: dict[str, torch.Tensor], recomputed: dict[str, torch.Tensor]) -> Difference:
    """How far the recorded recurrent state is from the recomputed one (non-finite: infinitely far)."""
    max_abs = max_rel = 0.0
    for name, theirs in recorded.items():
        ours = recomputed[name].float().cpu()
        gap = float((theirs - ours).abs().max()) if torch.isfinite(theirs).all() else float("inf")
        scale = float(ours.abs().max())
        max_abs = max(max_abs, gap)
        max_rel = max(max_rel, gap / scale if scale > 0 else (0.0 if gap == 0 else float("inf")))
    return Difference(max_abs, max_rel)
