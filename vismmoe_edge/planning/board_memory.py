"""The memory a Jetson module leaves a model, for plans made on another machine (`plan --profile P` off the board).

On the board the planner reads MemAvailable and the memory cgroup (plan.py). Anywhere else it plans for the
module instead of the host it runs on:

    available = MemTotal of the module (its DRAM less the boot carveouts)
              - the desktop-less OS and JetPack services at idle
              - a camera pipeline (one CSI camera through libargus)

Sources and status of each number are in docs/jetson.md ("Memory a plan assumes off the board"): MemTotal of the
Orin Nano 8 GB and Orin NX 16 GB is what tegrastats prints as the RAM total on those modules (7,620 MB and
15,388 MB); other modules take the same visible fraction [I]. The OS and camera figures are estimates [I] until
measured on a board (`free -b` after boot, then with the camera streaming).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vismmoe_edge.hardware import system
from vismmoe_edge.hardware.profiles import Profile
from vismmoe_edge.units import format_bytes

MIB = 1 << 20
GIB = 1 << 30
VISIBLE_MIB = {"Orin Nano 8GB": 7620, "Orin NX 16GB": 15388}  # MemTotal (tegrastats' RAM total, MiB)
VISIBLE_FRACTION = 7620 / 8192  # [I] other modules: the Nano 8 GB's carveout share
OS_BYTES = 900 * MIB  # [I] headless Ubuntu 22.04 + JetPack services at idle (tegrastats RAM used, 650-930 MB)
CAMERA_BYTES = 256 * MIB  # [I] nvargus-daemon and its capture buffers for one 1080p30 CSI camera


@dataclass(frozen=True)
class BoardMemory:
    module: str
    module_bytes: int  # the datasheet's DRAM
    visible_bytes: int  # MemTotal on the board
    os_bytes: int
    camera_bytes: int

    @property
    def available_bytes(self) -> int:
        return self.visible_bytes - self.os_bytes - self.camera_bytes

    def describe(self) -> str:
        return (
            f"the {self.module}'s memory, not this machine's: {format_bytes(self.visible_bytes)} MemTotal of "
            f"{format_bytes(self.module_bytes)} DRAM, less {format_bytes(self.os_bytes)} for the desktop-less OS "
            f"and JetPack services and {format_bytes(self.camera_bytes)} for a camera pipeline (docs/jetson.md)"
        )

    def as_dict(self) -> dict[str, int | str]:
        return {
            "module": self.module,
            "module_bytes": self.module_bytes,
            "visible_bytes": self.visible_bytes,
            "os_bytes": self.os_bytes,
            "camera_bytes": self.camera_bytes,
            "available_bytes": self.available_bytes,
        }


def board_memory(profile: Profile) -> BoardMemory | None:
    """What `profile`'s module leaves a model; None for profiles that are not a Jetson's."""
    if profile.kind != "jetson" or profile.module is None or profile.memory_gb is None:
        return None
    module_bytes = profile.memory_gb * GIB
    visible_mib = VISIBLE_MIB.get(profile.module)
    visible = visible_mib * MIB if visible_mib is not None else int(module_bytes * VISIBLE_FRACTION)
    return BoardMemory(profile.module, module_bytes, visible, OS_BYTES, CAMERA_BYTES)


def on_the_board(profile: Profile, root: Path = Path("/")) -> bool:
    """Whether this machine is the module `profile` describes (then its own MemAvailable is the truth)."""
    board = system.detect_jetson(root)
    return board is not None and board.module == profile.module
