"""The drafter service: hosts one drafter (DSpark / DFlash) behind DrafterService."""
