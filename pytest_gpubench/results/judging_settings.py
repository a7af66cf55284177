"""The settings a run is judged with (pure but for an older ledger's cells.yaml): each cell's
thresholds and runs, the command line's and the defaults in force, written into the ledger's meta
record as the run starts, and read back from it (a ledger of an earlier release: from its
cells.yaml and its command line)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveInt,
    ValidationError,
)

from pytest_gpubench.config.cell import Thresholds
from pytest_gpubench.config.load_profile import LoadThresholds
from pytest_gpubench.config.matrix import read_matrix
from pytest_gpubench.config.metrics import DEFAULT_RATIO_THRESHOLD, DEFAULT_SUCCESS_RATE, GATED
from pytest_gpubench.config.options import DEFAULT_SAMPLE_ON_SECONDS, FLAGS
from pytest_gpubench.core.errors import GpubenchError, key_path
from pytest_gpubench.ledger.schema import MetaRecord
from pytest_gpubench.results.decision import ALPHA, MIN_HISTORY

if TYPE_CHECKING:
    from pytest_gpubench.config.cell import Cell


# The meta record's key for the settings (whose shape has its `version`).
SETTINGS_KEY = "judging"
# The thresholds' relative keys with a default (config/metrics.GATED but the opt-in ones), written
# resolved: a later release's defaults never change how a ledger written today is judged.
RATIO_FIELDS = tuple(figure.threshold_key for figure in GATED if not figure.opt_in)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CellJudging(_Strict):
    """What judging one cell needs: its thresholds (defaults resolved), its load points',
    its runs (the most an A/B pair sequence may take), min_runs (sequential looks), its A/B
    reference, and whether it may go unmeasured."""

    node: str
    thresholds: Thresholds
    load: LoadThresholds | None = None
    runs: PositiveInt
    min_runs: PositiveInt | None = None
    reference: str | None = None
    optional: bool = False
    skip: str | None = None
    # The cell's token_check (issue 35): `fail` makes a token-count mismatch a regression.
    token_check: Literal["warn", "fail", "off"] = "warn"


class JudgingSettings(_Strict):
    """A run's effective settings for judging: each cell's, the command line's and the
    defaults in force, exactly as the session used them."""

    version: Literal[1] = 1
    cells: dict[str, CellJudging] = {}
    # --gpubench-runs, or the ini file's gpubench_runs: the runs every cell was asked for.
    runs_override: PositiveInt | None = None
    accept_incomparable: bool = False
    baseline_update: bool = False
    smoke: bool = False
    alpha: float = ALPHA
    min_history: int = MIN_HISTORY
    # An undecided figure's budget past the planned runs (results/sample_on.py): its runs (None:
    # as many again as were planned; 0: none) and seconds per (cell, prompt).
    sample_on_runs: NonNegativeInt | None = None
    sample_on_seconds: NonNegativeFloat = DEFAULT_SAMPLE_ON_SECONDS
    # The calibration a --baseline-update was a run of (--gpubench-calibration): its history
    # entries say so, and none is a ratified step from the one before it.
    calibration: str | None = None

    @classmethod
    def of_cells(
        cls,
        cells: Sequence[Cell],
        *,
        runs_override: int | None = None,
        accept_incomparable: bool = False,
        baseline_update: bool = False,
        smoke: bool = False,
        sample_on_runs: int | None = None,
        sample_on_seconds: float = DEFAULT_SAMPLE_ON_SECONDS,
        calibration: str | None = None,
    ) -> JudgingSettings:
        """The settings of a run of these cells (the matrix's, or a shard's share of it)."""
        return cls(
            cells={cell.cell_id: _cell_judging(cell) for cell in cells},
            runs_override=runs_override,
            accept_incomparable=accept_incomparable,
            baseline_update=baseline_update,
            smoke=smoke,
            sample_on_runs=sample_on_runs,
            sample_on_seconds=sample_on_seconds,
            calibration=calibration,
        )

    @classmethod
    def from_record(cls, data: Any, source: str) -> JudgingSettings:
        """The settings a ledger recorded; a bad record is one line naming the key."""
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            error = exc.errors()[0]
            where = key_path(tuple(error["loc"]))
            raise GpubenchError(
                f"{source}: meta record: {SETTINGS_KEY}.{where}: {error['msg']}"
            ) from None

    def to_record(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_defaults=False)

    @property
    def writes_baselines(self) -> bool:
        """--baseline-update writes baselines from the run (never from --smoke's one call)."""
        return self.baseline_update and not self.smoke

    def cell(self, cell_id: str) -> CellJudging | None:
        return self.cells.get(cell_id)

    def thresholds(self) -> dict[str, Thresholds]:
        return {cell_id: cell.thresholds for cell_id, cell in self.cells.items()}

    def load_thresholds(self) -> dict[str, LoadThresholds]:
        return {cell_id: cell.load for cell_id, cell in self.cells.items() if cell.load}


def resolved_thresholds(thresholds: Thresholds) -> Thresholds:
    """The thresholds with every relative default and the success rate's written in."""
    defaults: dict[str, float] = {
        name: DEFAULT_RATIO_THRESHOLD for name in RATIO_FIELDS if thresholds.ratio(name) is None
    }
    if thresholds.success_rate is None:
        defaults["success_rate"] = DEFAULT_SUCCESS_RATE
    return thresholds.model_copy(update=defaults)


def _cell_judging(cell: Cell) -> CellJudging:
    return CellJudging(
        node=cell.spec.node,
        thresholds=resolved_thresholds(cell.thresholds),
        load=cell.load.thresholds if cell.load is not None else None,
        runs=cell.runs,
        min_runs=cell.spec.min_runs,
        reference=cell.reference,
        optional=cell.spec.optional,
        skip=cell.spec.skip,
        token_check=cell.spec.token_check or "warn",
    )


def settings_of_ledger(
    meta: MetaRecord, source: str, *, cells_path: Path | None = None
) -> tuple[JudgingSettings, list[str]]:
    """The settings a ledger is judged with: those its meta record holds. A ledger written before
    they were recorded is judged with its cells.yaml as it is now (or the one named) and the runs
    on its command line, else the defaults, with a note saying what was assumed."""
    recorded = meta.get(SETTINGS_KEY)
    if recorded is not None:
        settings = JudgingSettings.from_record(recorded, source)
        ignored = [] if cells_path is None else [f"--cells {cells_path} ignored: {RECORDED}"]
        return settings, ignored

    cells = cells_path or (Path(meta["cells_file"]) if meta.get("cells_file") else None)
    prompts = Path(meta["prompts_file"]) if meta.get("prompts_file") else None
    runs = runs_on_command_line(meta)
    older = "the ledger records no settings (written by an earlier release)"
    if cells is None or prompts is None or not cells.exists() or not prompts.exists():
        return JudgingSettings(runs_override=runs), [f"{older}: default thresholds for every cell"]
    try:
        matrix = read_matrix(cells, prompts)
    except GpubenchError as exc:
        return JudgingSettings(runs_override=runs), [
            f"{older}: default thresholds for every cell: {exc}"
        ]
    assumed = f"{older}: judged with {cells} as it is now"
    if runs is not None:
        assumed += f" and --gpubench-runs {runs} from its command line"
    return JudgingSettings.of_cells(matrix.cells, runs_override=runs), [assumed]


def unchecked_cells(meta: Mapping[str, Any]) -> list[str]:
    """The cells whose token counts a run left unchecked (token_check: off), as the settings
    recorded in its meta record say (a report reads them there, as `gpubench gate` does)."""
    recorded = meta.get(SETTINGS_KEY)
    cells = recorded.get("cells") if isinstance(recorded, Mapping) else None
    if not isinstance(cells, Mapping):
        return []
    return [
        str(cell_id)
        for cell_id, cell in cells.items()
        if isinstance(cell, Mapping) and cell.get("token_check") == "off"
    ]


def wrote_baselines(meta: Mapping[str, Any]) -> bool:
    """Whether a run was a baseline update (--baseline-update, by either name, on its command
    line or in addopts; never with --smoke, which writes none), as the settings recorded in its
    meta record say; a ledger of an earlier release, which recorded none, by its command line."""
    recorded = meta.get(SETTINGS_KEY)
    if isinstance(recorded, Mapping):
        return recorded.get("baseline_update") is True and recorded.get("smoke") is not True
    command = meta.get("command_line")
    words = command if isinstance(command, list) else str(command or "").split()
    # A word that is no text (an edited ledger's) is no flag.
    return any(isinstance(word, str) and word in _BASELINE_UPDATE_FLAGS for word in words)


_BASELINE_UPDATE_FLAGS = frozenset(
    name
    for flag in FLAGS
    if flag.dest == "gpubench_baseline_update"
    for name in (flag.name, flag.alias)
)


RECORDED = "the ledger records the settings its run was judged with"


def runs_on_command_line(meta: MetaRecord) -> int | None:
    """An older ledger's --gpubench-runs, read from its command line (None when not given)."""
    command = meta.get("command_line")
    # A hand-edited meta record's command line that is no list (a bool, a text) says nothing.
    argv = [str(arg) for arg in command] if isinstance(command, list) else []
    for index, arg in enumerate(argv):
        value = None
        if arg == "--gpubench-runs" and index + 1 < len(argv):
            value = argv[index + 1]
        elif arg.startswith("--gpubench-runs="):
            value = arg.split("=", 1)[1]
        if value is not None and value.isdigit() and int(value) > 0:
            return int(value)
    return None
