"""The verifier service: hosts the target model and dspark_core.verifier.Verifier behind VerifierService."""
