"""Userspace WAN emulator: a shaped TCP relay (`relay`) over a pure shaper
(`shaper`), an HTTP control API (`control`) and `pdd wan` (`cli`)."""
