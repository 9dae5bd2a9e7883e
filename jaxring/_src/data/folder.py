"""``ImageFolder``: the file list and labels of ImageNet in its standard layout.

Layouts understood (``root`` is the folder holding ``train/`` and ``val/``)::

  root/train/<wnid>/*.JPEG                        one folder per class
  root/val/<wnid>/*.JPEG                          the same, for validation
  root/val/*.JPEG + a labels file                 the flat layout of the ILSVRC download

A labels file is either Kaggle's ``LOC_val_solution.csv`` (``ImageId,PredictionString``, the first
token of the prediction string is the wnid) or a plain text file of ``filename wnid`` lines. Images
are matched to labels by file name without extension. The class list, and so the label of each
wnid, is the sorted list of class folders of ``root/train`` for every split, so that validation
labels agree with training labels even where a validation subset lacks some classes.
"""
from __future__ import annotations

import os
import pathlib
from typing import Sequence

import numpy as np

IMAGE_EXTENSIONS = (".jpeg", ".jpg", ".png")
# Searched in root/<split>, root and up to three parents (Kaggle puts the CSV three levels above
# ILSVRC/Data/CLS-LOC).
_LABEL_FILE_NAMES = ("LOC_{split}_solution.csv", "{split}_labels.txt", "{split}_labels.csv")


def _is_image(name: str) -> bool:
  return name.lower().endswith(IMAGE_EXTENSIONS) and not name.startswith(".")


def _list_images(folder: pathlib.Path) -> list[str]:
  with os.scandir(folder) as entries:
    return sorted(e.name for e in entries if _is_image(e.name) and e.is_file())


def _list_class_folders(folder: pathlib.Path) -> list[str]:
  with os.scandir(folder) as entries:
    return sorted(e.name for e in entries if e.is_dir() and not e.name.startswith("."))


def find_labels_file(root: pathlib.Path, split: str) -> pathlib.Path | None:
  """The labels file of a flat split, or None (see the module docstring for where it looks)."""
  folders = [root / split, root, *list(root.parents)[:3]]
  names = [n.format(split=split) for n in _LABEL_FILE_NAMES]
  for folder in folders:
    for name in names:
      if (folder / name).is_file():
        return folder / name
  for name in ("labels.txt", "labels.csv"):
    if (root / split / name).is_file():
      return root / split / name
  return None


def read_labels_file(path: pathlib.Path) -> dict[str, str]:
  """``{image name without extension: wnid}`` from a Kaggle CSV or a ``filename wnid`` text file."""
  labels = {}
  with open(path) as f:
    for line_number, line in enumerate(f, 1):
      line = line.strip()
      if not line or line.startswith("#") or line.startswith("ImageId"):
        continue
      if "," in line:
        name, _, rest = line.partition(",")
        tokens = [name.strip(), *rest.split()]
      else:
        tokens = line.split()
      if len(tokens) < 2:
        raise ValueError(f"{path}:{line_number}: expected 'filename wnid', got {line!r}")
      name, wnid = tokens[0], tokens[1]
      if wnid.isdigit():
        raise ValueError(f"{path}:{line_number}: the label {wnid!r} is a number; ImageFolder reads "
                         "wnids (as in LOC_val_solution.csv), not ILSVRC class ids")
      labels[os.path.splitext(os.path.basename(name))[0]] = wnid
  if not labels:
    raise ValueError(f"the labels file {path} holds no labels")
  return labels


class ImageFolder:
  """The images of one split of an ImageNet-style folder and their integer labels.

  Args:
    root: the folder holding ``train/`` and ``val/`` (or other split folders).
    split: the split folder's name.
    num_classes: if given, the number of classes the folder must have (1000 for ImageNet).
    classes: the wnids, in label order; default: the class folders of ``root/train`` (sorted), or
      for a split without them, this split's own class folders or labels.
    labels_file: the labels file of a flat split (default: searched, see the module docstring).

  Attributes:
    classes: the wnids; label ``i`` is ``classes[i]``.
    paths: the image paths (sorted by class, then name).
    labels: int32 array, the label of each path.

  Raises:
    FileNotFoundError: ``root`` or ``root/split`` does not exist, or a flat split has no labels
      file.
    ValueError: no images, an empty class folder, an image without a label, a wnid that is not a
      class, or a class count other than ``num_classes``.

  Example:
    >>> train = ImageFolder("/data/imagenet", split="train", num_classes=1000)
    >>> train.num_classes, len(train), train.classes[:2]
    (1000, 1281167, ['n01440764', 'n01443537'])
  """

  def __init__(self, root: str | os.PathLike, split: str = "train", *,
               num_classes: int | None = None, classes: Sequence[str] | None = None,
               labels_file: str | os.PathLike | None = None):
    self.root = pathlib.Path(root)
    self.split = split
    if not self.root.is_dir():
      raise FileNotFoundError(f"ImageFolder: the dataset folder {self.root} does not exist")
    folder = self.root / split
    if not folder.is_dir():
      raise FileNotFoundError(f"ImageFolder: the split folder {folder} does not exist")
    class_folders = _list_class_folders(folder)
    if classes is None:
      classes = self._default_classes(class_folders, labels_file)
    self.classes = list(classes)
    if num_classes is not None and num_classes != len(self.classes):
      raise ValueError(f"ImageFolder: expected num_classes={num_classes} but {self.root} has "
                       f"{len(self.classes)} classes")
    if class_folders:
      paths, labels = self._scan_class_folders(folder, class_folders)
    else:
      paths, labels = self._scan_flat(folder, labels_file)
    if not paths:
      raise ValueError(f"ImageFolder: no images ({', '.join(IMAGE_EXTENSIONS)}) in {folder}")
    self.paths = paths
    self.labels = np.asarray(labels, np.int32)

  @property
  def num_classes(self) -> int:
    return len(self.classes)

  def __len__(self) -> int:
    return len(self.paths)

  def __getitem__(self, index: int) -> tuple[str, int]:
    return self.paths[index], int(self.labels[index])

  def __repr__(self) -> str:
    return (f"ImageFolder({str(self.root)!r}, split={self.split!r}: {len(self)} images, "
            f"{self.num_classes} classes)")

  def _default_classes(self, class_folders: list[str], labels_file) -> list[str]:
    train = self.root / "train"
    if self.split != "train" and train.is_dir():
      train_classes = _list_class_folders(train)
      if train_classes:
        return train_classes
    if class_folders:
      return class_folders
    path = self._labels_path(labels_file)
    if path is None:
      return []  # no class folders and no labels file: _scan_flat reports it
    return sorted(set(read_labels_file(path).values()))

  def _labels_path(self, labels_file) -> pathlib.Path | None:
    if labels_file is not None:
      path = pathlib.Path(labels_file)
      if not path.is_file():
        raise FileNotFoundError(f"ImageFolder: the labels file {path} does not exist")
      return path
    return find_labels_file(self.root, self.split)

  def _scan_class_folders(self, folder: pathlib.Path, class_folders: list[str]):
    label_of = {wnid: i for i, wnid in enumerate(self.classes)}
    unknown = [w for w in class_folders if w not in label_of]
    if unknown:
      raise ValueError(f"ImageFolder: {folder} has class folders {unknown[:5]} that are not among "
                       f"the {len(self.classes)} classes of {self.root / 'train'}")
    paths, labels = [], []
    for wnid in class_folders:
      names = _list_images(folder / wnid)
      if not names:
        raise ValueError(f"ImageFolder: the class folder {folder / wnid} holds no images")
      paths += [str(folder / wnid / n) for n in names]
      labels += [label_of[wnid]] * len(names)
    return paths, labels

  def _scan_flat(self, folder: pathlib.Path, labels_file):
    names = _list_images(folder)
    if not names:
      return [], []
    path = self._labels_path(labels_file)
    if path is None:
      raise FileNotFoundError(
          f"ImageFolder: {folder} holds images but no class folders, and no labels file was found "
          f"(looked for {', '.join(n.format(split=self.split) for n in _LABEL_FILE_NAMES)} in "
          f"{folder}, {self.root} and its parents); pass labels_file=")
    wnid_of = read_labels_file(path)
    label_of = {wnid: i for i, wnid in enumerate(self.classes)}
    paths, labels, missing = [], [], []
    for name in names:
      wnid = wnid_of.get(os.path.splitext(name)[0])
      if wnid is None:
        missing.append(name)
        continue
      if wnid not in label_of:
        raise ValueError(f"ImageFolder: {path} labels {name} as {wnid!r}, which is not among the "
                         f"{len(self.classes)} classes")
      paths.append(str(folder / name))
      labels.append(label_of[wnid])
    if missing:
      raise ValueError(f"ImageFolder: {len(missing)} images in {folder} have no label in {path}, "
                       f"e.g. {missing[:3]}")
    return paths, labels
