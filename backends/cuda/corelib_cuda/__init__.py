"""corelib backend plugin for cuda devices (native, or the stream emulator with the cuda profile)."""
