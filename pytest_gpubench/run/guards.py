"""The reproducibility guards a run checks before it measures: a clean git tree, a quiet
machine, and prompts unchanged since their baselines (one check each, all here)."""

from __future__ import annotations

from pathlib import Path

from pytest_gpubench.config.cell import Cell
from pytest_gpubench.config.load_profile import dataset_prompt_id
from pytest_gpubench.config.matrix import Matrix, load_dataset_sha256
from pytest_gpubench.config.prompts import RequestShape, frozen_prompt_error
from pytest_gpubench.core.errors import GpubenchError
from pytest_gpubench.core.provenance import GitState, git_state, load_average
from pytest_gpubench.results.baseline_format import CorruptBaseline

SHOWN_DIRTY_FILES = 5


def check_git_tree(root: Path, ledger_dir: Path, *, allow_dirty: bool) -> GitState:
    """The git state for the meta record; refuses a dirty tree unless allowed. The ledgers the
    run itself writes (when they lie inside the tree) do not make it dirty."""
    git = git_state(root)
    ledger_prefix = _relative_prefix(ledger_dir, root)
    if ledger_prefix:
        git["git_dirty_files"] = [
            name for name in git["git_dirty_files"] if not name.startswith(ledger_prefix)
        ]
        git["git_dirty"] = bool(git["git_dirty_files"])
    if git["git_dirty"] and not allow_dirty:
        shown = ", ".join(git["git_dirty_files"][:SHOWN_DIRTY_FILES])
        more = len(git["git_dirty_files"]) - SHOWN_DIRTY_FILES
        shown += f" and {more} more" if more > 0 else ""
        raise GpubenchError(
            f"git tree {root} has uncommitted changes ({shown}): commit them, "
            "or pass --gpubench-allow-dirty to measure anyway (the dirty files go into the ledger)"
        )
    return git


def check_load(threshold: float, *, force_load: bool) -> None:
    """Numbers measured on a busy machine are not comparable: refuse unless forced."""
    load = load_average()
    if load > threshold and not force_load:
        raise GpubenchError(
            f"1-minute load average is {load:.2f}, above {threshold:g}: "
            "numbers measured now would not be comparable; wait, or pass --gpubench-force-load"
        )


def check_frozen_prompts(
    matrix: Matrix, baselines_dir: Path, *, replacing_corrupt: bool = False
) -> None:
    """A prompt never changes under an id that a baseline was measured with. A corrupt baseline
    is refused, unless this run replaces it (--baseline-update): it holds no prompt to check."""
    # Reading baselines needs pandas (their summaries): only once a benchmark runs.
    from pytest_gpubench.results.baseline import find_baseline

    for cell in matrix.cells:
        try:
            baseline = find_baseline(baselines_dir, cell.cell_id)
        except CorruptBaseline:
            if not replacing_corrupt:
                raise
            continue
        # A prompt measured on one of the cell's adapters is judged as `<prompt>@<adapter>`.
        judged = {judged: (source, adapter) for judged, source, adapter in cell.case_prompts()}
        for recorded in baseline.prompts if baseline else []:
            source, adapter = judged.get(recorded.prompt_id, (recorded.prompt_id, None))
            prompt = matrix.prompts.get(source)
            if prompt is None or prompt.synthetic is not None:
                continue  # a synthetic prompt's text is made on the live cell: checked there
            request = cell.adapter_request(cell.request_for(prompt), adapter)
            error = frozen_prompt_error(
                recorded.prompt_id,
                cell.cell_id,
                baseline_sha256=recorded.prompt_sha256,
                current_sha256=prompt.sha256(request),
                source=matrix.prompts_path,
            )
            if error is not None:
                raise error
        _check_frozen_dataset(cell, baselines_dir)


def _check_frozen_dataset(cell: Cell, baselines_dir: Path) -> None:
    """A load case's dataset sends what its load baseline was measured with: an edit to the
    file that changes the sampled prompts stops the run, as a changed prompt does."""
    if cell.load is None or cell.load.dataset is None:
        return
    from pytest_gpubench.results.load_baseline import read_load_baseline

    prompt_id = dataset_prompt_id(cell.load.dataset)
    current = load_dataset_sha256(cell.load, cell.spec.request or RequestShape())
    for point in read_load_baseline(baselines_dir, cell.cell_id).values():
        if point.get("prompt_id") != prompt_id:
            continue
        error = frozen_prompt_error(
            prompt_id,
            cell.cell_id,
            baseline_sha256=point.get("prompt_sha256"),
            current_sha256=current,
            source=Path(cell.load.dataset.path),
        )
        if error is not None:
            raise error


def _relative_prefix(path: Path, root: Path) -> str | None:
    try:
        return path.resolve().relative_to(root.resolve()).as_posix().rstrip("/") + "/"
    except ValueError:
        return None


class FrozenRequests:
    """A test's own request never changes under its id (the test's name), like a prompt of
    prompts.yaml: the first request a (cell, test) sends in a run must be the one its baseline
    was measured with, and every later one in the run the same as the first."""

    def __init__(self, baselines_dir: Path) -> None:
        self.baselines_dir = baselines_dir
        # {(cell id, test id): (sha256, what it was measured with)}
        self._frozen: dict[tuple[str, str], tuple[str, str]] = {}
        self._read: set[str] = set()

    def check(
        self, cell_id: str, test_id: str, sha256: str, where: str, kind: str = "benchmark test"
    ) -> None:
        """Raises GpubenchError naming the test (at `where`) when its request changed; `kind`
        says what it is (a test, or a prompt whose text is made on the live cell)."""
        self._read_baseline(cell_id)
        known = self._frozen.get((cell_id, test_id))
        if known is None:
            self._frozen[(cell_id, test_id)] = (sha256, "its first call in this run")
            return
        frozen, since = known
        if frozen != sha256:
            raise GpubenchError(
                f"{where}: {kind} {test_id} changed its request since {since} on "
                f"{cell_id} (sha256 {frozen[:12]} -> {sha256[:12]}): a test's request (messages, "
                "max_tokens, options) is frozen under its name like a prompt in prompts.yaml; "
                f"restore it, or measure the new request in a test with a new name"
            )

    def _read_baseline(self, cell_id: str) -> None:
        if cell_id in self._read:
            return
        self._read.add(cell_id)
        from pytest_gpubench.results.baseline import find_baseline

        baseline = find_baseline(self.baselines_dir, cell_id)
        for recorded in baseline.prompts if baseline else []:
            if recorded.prompt_sha256 is not None:
                since = "the baseline was measured"
                self._frozen[(cell_id, recorded.prompt_id)] = (recorded.prompt_sha256, since)
