"""corelib backend plugin for mlu devices (native, or the stream emulator with the mlu profile)."""
