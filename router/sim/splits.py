"""How a capacity sweep splits its GPUs: N prefill instances at degree P + M decode instances at
degree D (`N@P+M@D`), each side timed by the profile scaled to its degree."""

from __future__ import annotations

from dataclasses import dataclass

from halfmoon.router.degree import profile_for_pools
from halfmoon.router.profile import Profile


@dataclass(slots=True, frozen=True)
class Split:
    """`num_prefill` instances of `prefill_degree` GPUs + `num_decode` of `decode_degree`."""

    num_prefill: int
    prefill_degree: int
    num_decode: int
    decode_degree: int

    @property
    def num_gpus(self) -> int:
        return self.num_prefill * self.prefill_degree + self.num_decode * self.decode_degree

    @property
    def name(self) -> str:
        """`2P@tp4+4D@tp2`."""
        prefill = f"{self.num_prefill}P@tp{self.prefill_degree}"
        return f"{prefill}+{self.num_decode}D@tp{self.decode_degree}"

    def profile(self, profile: Profile) -> Profile:
        """`profile` with its prefill side at this split's prefill degree and its decode side at
        its decode degree; a ProfileError naming the side whose devices cannot hold the weights."""
        return profile_for_pools(profile, self.prefill_degree, self.decode_degree)


def parse_split(text: str, degree: int) -> Split:
    """`2@4+4@2` (2 prefill instances at degree 4 + 4 decode at 2), `13+3` (both at `degree`)
    or a split's name (`13P@tp8+3D@tp8`); a ValueError when it is none of these."""
    bare = text.strip().upper().replace("TP", "").replace("P", "").replace("D", "")
    prefill, plus, decode = bare.partition("+")
    if not plus:
        raise ValueError(f"{text!r} has no '+'")
    return Split(*_side(prefill, degree), *_side(decode, degree))


def _side(text: str, degree: int) -> tuple[int, int]:
    count, at, own = text.partition("@")
    return int(count), int(own) if at else degree
