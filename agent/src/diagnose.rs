//! Why did it die: classify how an instance of a unit ended, from evidence.
