"""corelib backend plugin for npu devices (native, or the stream emulator with the npu profile)."""
