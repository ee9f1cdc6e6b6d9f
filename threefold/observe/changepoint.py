"""When the run changed: CUSUM change points over step time and each category's share.

    det = detector(cfg, grid)          # rank 0's diagnosis builds it (observe/diagnose.py)
    det.on_step(step, record)          # every step: rank 0's step_time_s
    det.on_report(view)                # report steps: every rank's means since the last report

Step time. Past start-up (SKIP steps) a window of WARMUP steps gives the level and noise, robustly
(median, MAD); then EWMAs follow them while the run is in control. Each step's deviation in noise
units, clipped at CLIP (one save, evaluation or hiccup adds at most CLIP - K < H), feeds an upward
CUSUM with allowance K; past H the change is dated at the step after the sum last left zero (the
classic CUSUM change-time estimate, Page 1954). It is named only if the two report windows after
that date both run log.change_min (relative) above the level before: a burst of another job on a
shared host rarely lasts two windows (one of ten steps did in a clean run here). A second window
that runs log.change_min above the first re-dates the change to its start and confirms it on the
next (a burst the change followed at once must not stand in for it, nor a change still ramping),
unless the first window's rise was a change of its own (attribution: where the time goes moved) and
the larger of the two: then it is named from that window, and the later rise is measured from its
level. A larger rise that re-dated a change of its own and falls back in its confirming window
(nearer the change's pace than its own) was a burst on the slow rank: the earlier change is named.
The date named is CUSUM's or, where the steps after it split better later (the least-squares split
of one shift in mean) and those skipped do not rise on their own, that later step: a level learned
in a burst dates too early.
Named or not, the new pace becomes the level. So does a pace that fell and stays down (a downward
CUSUM of the same deviations): a burst that became the level has passed, and a change after it is
measured against the run's pace, not the burst's. Nor is a rise named that the windows show spread over
every rank and category in proportion to the step before (another job's load on a shared host; a
slower clock on every device): nothing in where the time goes moved, so there is nothing to name,
and on this project's shared CPU hosts it is what a clean run's noise looks like.

Attribution: observe/attribution.py, the last report window before the date against the window
that confirmed it (the second after it: a burst just before a change sits in the first, the change
lasts into the second).

Shares. Per report window each category's share of the step (mean over ranks) runs through an
upward CUSUM of its own, its level and noise learned from the first windows past start-up or,
with log.bands, the band's (centre, half the width as noise, the width as the least rise named).
A share that rises by SHARE_MIN for two windows with no step-time change near it is named on its
own ("dp_exposed 4% -> 28% of the step since step 300").

State: O(1) per series (level, scale, sum, date, a bounded buffer of step times); the report work
is O(world) on rank 0, on report steps only.
"""

from __future__ import annotations

import statistics
from collections import deque

from threefold.observe.attribution import attribution, median
from threefold.observe.findings import Finding
from threefold.observe.spans import CATEGORIES

SKIP = 3
"""Start-up steps never learned from: step 1 compiles, the next ones still warm allocator and caches."""
WARMUP = 12
"""Steps (after SKIP) whose median and MAD are the first level and noise of step time."""
K = 1.0
"""CUSUM allowance in noise units: shifts of about 2 noise units or more accumulate."""
H = 8.0
"""CUSUM decision threshold in noise units: at least three slow steps in a row at the clip."""
CLIP = 4.0
"""Largest deviation one step may add (noise units): one outlier step cannot alarm alone."""
SCALE_FLOOR = 0.03
"""Noise is at least this fraction of the level: a very steady warm-up must not make 1% drifts alarms."""
ALPHA = 0.05
"""EWMA weight of an in-control step in the level and the noise (about the last 20 steps)."""
MIN_AFTER = 3
"""Fewest steps of a confirming window (their median against the level before the date)."""
KEEP = 64
"""Most recent step times kept for the confirmation: bounded state, whatever the run's length."""
CHANGE_MIN = 0.2
"""log.change_min's default: the least relative rise of step time named (a busy shared host moves a
clean run's step time by 10% between windows, and a burst by more, rarely for two windows)."""
SHARE_MIN = 0.20
"""Smallest rise of a category's share (of the step, absolute) named on its own, without bands. On
this project's shared 2-core hosts a clean dp2 run's dp_exposed share moves 3% <-> 23% between
windows for two or three windows at a time (the ranks drift apart when another job takes a core)."""
SHARE_WARMUP = 3
"""Report windows after the first (which holds start-up) whose median is a share's level."""
SHARE_SCALE_FLOOR = 0.02
"""A share's noise is at least two points of the step."""
SHARE_H = 5.0
"""Share CUSUM threshold in noise units (windows average several steps: less noisy than steps)."""
VIEWS = 6
"""Report views kept for the before/after comparison."""


class Cusum:
    """One-sided upward CUSUM of deviations in noise units; remembers where it last left zero."""

    def __init__(self, k: float = K, h: float = H, clip: float = CLIP):
        self.k, self.h, self.clip = k, h, clip
        self.s = 0.0
        self.zero_at = 0
        """The last index at which the sum was zero: the change is dated at the next one."""

    def update(self, index: int, z: float) -> bool:
        """Add deviation `z` seen at `index`; True while the sum is past the threshold."""
        self.s = max(0.0, self.s + min(z, self.clip) - self.k)
        if self.s == 0.0:
            self.zero_at = index
        return self.s > self.h

    def reset(self, index: int) -> None:
        self.s, self.zero_at = 0.0, index


class Level:
    """A series' robust level and noise: median and MAD of a warm-up window, then EWMAs of the
    value and of its absolute deviation while the series is in control."""

    def __init__(self, warmup: int, floor: float, relative: bool):
        self.warmup, self.floor, self.relative = warmup, floor, relative
        self.seen: list[float] = []  # the warm-up window only: bounded by `warmup`
        self.level: float | None = None
        self.scale = 0.0

    @property
    def ready(self) -> bool:
        return self.level is not None

    def set(self, level: float, scale: float) -> None:
        self.level, self.scale, self.seen = level, scale, []

    def learn(self, x: float) -> None:
        """One warm-up value; the level is set once the window is full."""
        self.seen.append(x)
        if len(self.seen) >= self.warmup:
            med = statistics.median(self.seen)
            mad = statistics.median(abs(v - med) for v in self.seen)
            self.set(med, 1.4826 * mad)

    def noise(self) -> float:
        floor = self.floor * abs(self.level) if self.relative else self.floor
        return max(self.scale, floor, 1e-12)

    def z(self, x: float) -> float:
        return (x - self.level) / self.noise()

    def follow(self, x: float) -> None:
        """An in-control value moves the level and the noise a little (drift is not a change)."""
        dev = min(abs(x - self.level), CLIP * self.noise())  # an outlier does not inflate the noise
        self.level += ALPHA * (x - self.level)
        self.scale += ALPHA * (1.2533 * dev - self.scale)  # E|x - mean| is 0.80 sigma for a normal


def _share_rows(view) -> dict[str, float]:
    """Each category's share of the step, the mean over ranks of the report window."""
    out = dict.fromkeys(CATEGORIES, 0.0)
    n = 0
    for row in view.ranks:
        wall = row.get("wall_s") or sum(row["time_s"].values())
        if wall <= 0:
            continue
        n += 1
        for c in CATEGORIES:
            out[c] += row["time_s"].get(c, 0.0) / wall
    return {c: v / n for c, v in out.items()} if n else {}


def _onset(recent, since: int, upto: int, was: float, least: float, lead: int) -> int:
    """The change's first step: `since` (CUSUM's date) or a later step where the steps from
    `lead` before `since` to `upto` split best into two means (the least-squares split of one
    shift), provided the steps it skips do not run `least` above the level `was` themselves (a
    rise of their own: a later burst must not move the date past it). CUSUM dates a change where
    its sum last left zero; after a level learned in a burst that still runs a little above it,
    that is where the burst began to ebb, before the change."""
    steps = [(s, x) for s, x in recent if since - lead <= s <= upto]
    best, onset = float("-inf"), since
    for k, (t, _) in enumerate(steps):
        if t < since or k < MIN_AFTER or len(steps) - k < MIN_AFTER:
            continue
        if t > since and median(x for s, x in steps[:k] if s >= since) / was - 1 >= least:
            break
        left, right = [x for _, x in steps[:k]], [x for _, x in steps[k:]]
        score = (statistics.fmean(right) - statistics.fmean(left)) * (len(left) * len(right) / len(steps)) ** 0.5
        if score > best:
            best, onset = score, t
    return onset


class ShareSeries:
    """One category's share of the step, one value per report window: an upward CUSUM (a
    category taking more of the step is what costs; one taking less is named by the one that
    rose, as shares sum to one)."""

    def __init__(self, band=None):
        self.level = Level(SHARE_WARMUP, SHARE_SCALE_FLOOR, relative=False)
        self.least = SHARE_MIN
        if band is not None:  # the tuned run's expectation: centre, half the width as noise, and
            self.level.set(band.share, band.width / 2)  # outside the band as the least rise named
            self.least = band.width
        self.cusum = Cusum(K, SHARE_H)
        self.last: float | None = None

    def update(self, step: int, start: int, share: float) -> tuple[int, float] | None:
        """The window of steps `start`..`step`; (the change's first step, the level before) when the
        share has risen by SHARE_MIN (or out of its band) for two windows in a row and the CUSUM
        says it is no noise."""
        last, self.last = self.last, share
        if last is None:  # the first window checked: a change dates from its start at the earliest
            self.cusum.reset(start - 1)
        if not self.level.ready:
            self.level.learn(share)
            self.cusum.reset(step)
            return None
        z = self.level.z(share)
        alarm = self.cusum.update(step, z)
        risen = all(v - self.level.level >= self.least for v in (share, share if last is None else last))
        if not (alarm and risen):
            if self.cusum.s <= SHARE_H / 2 and z < CLIP:
                self.level.follow(share)
            return None
        found = (self.cusum.zero_at + 1, self.level.level)
        self.level.set(share, self.level.scale)  # the new share is the level: not a change again
        self.cusum.reset(step)
        return found


class ChangeDetector:
    """Rank 0's change points of one attempt (observe/diagnose.py calls it)."""

    def __init__(
        self, change_min: float = CHANGE_MIN, bands: dict | None = None, spans: bool = True, interval: int = 10
    ):
        self.change_min, self.spans, self.interval = change_min, spans, interval
        self.level = Level(WARMUP, SCALE_FLOOR, relative=True)
        self.cusum = Cusum()
        self.fall = Cusum()
        """A downward CUSUM of the same deviations: a pace that fell and stays down is the level."""
        self.recent: deque[tuple[int, float]] = deque(maxlen=KEEP)  # (step, seconds)
        self.pending: int | None = None
        self.origin = 0
        """The alarm's first date: the report window before it is the attribution's baseline."""
        """The date of a step-time alarm not confirmed yet."""
        self.first: tuple | None = None
        self.earlier: tuple | None = None
        """(date, pace, last step) of a change of its own re-dated by a larger rise after it."""
        """(its first window's view, the window's end) once that window held the rise."""
        self.views: deque = deque(maxlen=VIEWS)
        self.shares = {c: ShareSeries((bands or {}).get(c)) for c in CATEGORIES}
        self.dates: deque[int] = deque(maxlen=8)  # the step-time changes named: their dates

    def on_step(self, step: int, record: dict) -> list[Finding]:
        """`step` counts from 1. Steps with a held-out evaluation are not the run's pace."""
        x = record.get("step_time_s")
        if not isinstance(x, (int, float)) or not x > 0 or step <= SKIP or "val_loss" in record:
            return []
        self.recent.append((step, float(x)))
        if not self.level.ready:
            self.level.learn(x)
            self.cusum.reset(step)
            self.fall.reset(step)
            return []
        alarm = self.cusum.update(step, self.level.z(x))
        fell = self.fall.update(step, -self.level.z(x))
        if self.cusum.s == 0.0:
            self.pending = self.first = self.earlier = None  # back in control: a burst
        elif alarm and self.pending is None:
            self.pending = self.origin = self.cusum.zero_at + 1
        if fell and self.pending is None:
            # The pace fell and stays down: a burst that became the level (another job's load,
            # spread alike over every rank) has passed, or the run sped up. The steps since the
            # fall are the level at once; following it at ALPHA would take some 20 steps, and a
            # change in them would be measured, and confirmed late, against the burst's pace.
            self._adopt(median(v for s, v in self.recent if s > self.fall.zero_at), step)
            return []
        if self.pending is None and self.cusum.s <= H / 2 and self.level.z(x) < CLIP:
            self.level.follow(x)  # not while a change may be under way, nor from a slow outlier
        if not self.spans and self.pending is not None and self._window_done(step, self.interval):
            return self._confirm(step, None)  # without spans no report view comes: confirm here
        return []

    def _adopt(self, pace: float, step: int) -> None:
        """`pace` is the level from `step` on (its noise scaled alike: noise is relative), and
        both CUSUMs start again from zero."""
        self.level.set(pace, self.level.scale * pace / self.level.level)
        self.cusum.reset(step)
        self.fall.reset(step)

    def _window_done(self, step: int, steps: int) -> bool:
        """Whether the window ending at `step` lies after the pending date (its first or second)."""
        first = self.first[1] if self.first else self.pending - 1
        return step - first >= max(MIN_AFTER, steps)

    def on_report(self, view) -> list[Finding]:
        """A report step's view: confirm and attribute a step-time change, then the shares."""
        found = []
        if self.pending is not None and self._window_done(view.step, view.steps):
            found += self._confirm(view.step, view)
        self.views.append(view)
        if view.step - view.steps + 1 > 1:  # the first window holds start-up
            found += self._shares(view)
        return found

    def _confirm(self, step: int, view) -> list[Finding]:
        """A window after the pending date ends at `step`: the first of two that must both run
        log.change_min above the level before (a burst of another job rarely lasts two), then the
        second, which names the change."""
        since, was = self.pending, self.level.level
        start = self.first[1] + 1 if self.first else since
        pace = median(x for s, x in self.recent if start <= s <= step)
        if pace / was - 1 >= self.change_min and self.first is None:
            self.first = (view, step)
            return []
        upto, moved = step, None  # the change's pace is measured over its steps up to `upto`
        earlier = None  # or the steps of an earlier change, the confirming window's with them
        before = next((v for v in reversed(self.views) if v.step < self.origin), None)
        if self.first is not None:
            held = median(x for s, x in self.recent if since <= s <= self.first[1])
            if held > 0 and pace / held - 1 >= self.change_min:
                moved = attribution(before, self.first[0])
                if not moved.get("concentrated") or pace - held > held - was:
                    # The pace moved again after a first window that rose alike everywhere, or
                    # less than it rises now: a burst (or a smaller step) that a change followed
                    # at once, or a change still ramping. Date it from this window, confirm it on
                    # the next, and attribute it against the window before the alarm. (A burst
                    # on one rank's core looks like that rank's own change in its window's mean.)
                    self.earlier = (since, held, self.first[1]) if moved.get("concentrated") else None
                    self.pending, self.first = self.first[1] + 1, (view, step)
                    return []
                # The first window held the larger change, one of its own (where the time goes
                # moved): named from that window. The later rise (a busier host slowing the slow
                # rank further) is measured from that level on, a change of its own if it lasts.
                pace, upto, view = held, self.first[1], self.first[0]
            elif self.earlier is not None and pace - self.earlier[1] < held - pace:
                # The rise that re-dated a change of its own has passed (the pace fell back
                # nearer to the change's than to the rise's): a burst on the slow rank. The change
                # is the earlier one, at its pace before and after the burst, and attributed from
                # this window (the change without the burst).
                since, earlier = self.earlier[0], self.earlier[2]
        first_view = self.first[0] if self.first else None
        self.pending = self.first = self.earlier = None
        self._adopt(pace, step)  # named or not: it is not a change again
        if pace / was - 1 < self.change_min:
            return []
        since = _onset(self.recent, since, upto, was, self.change_min, lead=max(MIN_AFTER, self.interval))
        last = earlier or upto  # the change's own steps end here (the confirming window's follow)
        after = median(x for s, x in self.recent if since <= s <= last or (earlier and start <= s <= upto))
        rel = after / was - 1
        self.dates.append(since)
        text = f"step time {rel:+.0%} since step {since:,} ({was * 1e3:.0f} -> {after * 1e3:.0f} ms)"
        # Attributed from the confirming window: a change lasts into it, a burst that came just
        # before it (and so sits in the first window) rarely does.
        if moved is None:  # not attributed yet: from the confirming window (or the first, without spans)
            moved = attribution(before, view if view is not None else first_view)
        if moved and not moved["concentrated"]:
            return []  # the same step, slower alike everywhere: nothing moved to name (see above)
        if moved:
            text += f": {moved['text']}"
        return [
            Finding(
                kind="change",
                key=f"step_time@{since}",
                text=text,
                step=step,
                since=since,
                ranks=(moved["rank"],) if moved else (),
                group=moved.get("group", ""),
                category=moved.get("category", ""),
                value=rel,
                baseline=was,
                extra={k: moved[k] for k in ("moved_s", "wait", "link") if moved.get(k)} | {"step_time_s": after},
            )
        ]

    def _shares(self, view) -> list[Finding]:
        """The share that moved most in this window, if any did (the others moved with it: a
        share rises as the others fall); none when the step time changed near its date."""
        moves = {}
        for category, share in _share_rows(view).items():
            moved = self.shares[category].update(view.step, view.step - view.steps + 1, share)
            if moved is not None:
                moves[category] = (*moved, share)
        if not moves:
            return []
        category = max(moves, key=lambda c: abs(moves[c][2] - moves[c][1]))
        since, was, share = moves[category]
        # A share that moved with the step time is that change's attribution, already named.
        if self.pending is not None or any(abs(d - since) <= 2 * view.steps for d in self.dates):
            return []
        also = {c: round(m[2] - m[1], 4) for c, m in moves.items() if c != category}
        return [
            Finding(
                kind="change",
                key=f"{category}@{since}",
                text=f"{category} {was:.0%} -> {share:.0%} of the step since step {since:,}",
                step=view.step,
                since=since,
                category=category,
                value=share - was,
                baseline=was,
                extra={"also": also} if also else {},
            )
        ]


def detector(cfg, grid) -> ChangeDetector | None:
    """The change-point detector of this run; None with log.change_min 0 (off)."""
    log = cfg.log
    change_min = getattr(log, "change_min", CHANGE_MIN)
    if change_min <= 0:
        return None
    bands = None
    if getattr(log, "bands", ""):
        from threefold.observe.bands import read_bands

        bands = read_bands(log.bands)
    return ChangeDetector(change_min, bands, spans=bool(log.spans), interval=log.interval)
