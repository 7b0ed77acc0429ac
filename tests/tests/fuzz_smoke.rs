//! The fuzz targets' checks (`cachealloc_tests::fuzz`) as a bounded smoke run on stable Rust:
//! every input of the kept corpus (`tests/fuzz/corpus/TARGET/`), then seeded random and mutated
//! inputs. Longer runs, with coverage guidance, are `cargo +nightly fuzz run --fuzz-dir
//! tests/fuzz TARGET` (see RELIABILITY.md).

use std::path::PathBuf;

use cachealloc_tests::fuzz;

/// A small deterministic generator (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn bytes(&mut self, max_len: usize) -> Vec<u8> {
        let len = (self.next() as usize) % (max_len + 1);
        (0..len).map(|_| self.next() as u8).collect()
    }
}

fn corpus(target: &str) -> Vec<Vec<u8>> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target);
    let mut inputs: Vec<Vec<u8>> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| std::fs::read(e.unwrap().path()).unwrap())
        .collect();
    assert!(!inputs.is_empty(), "{} is empty", dir.display());
    inputs.sort();
    inputs
}

#[test]
fn config_parser_corpus_and_random_text() {
    for input in corpus("config") {
        fuzz::config(&String::from_utf8_lossy(&input));
    }
    let alphabet =
        b"max_split_size_mb:roundup_power2_divisions[]>,:.0123456789reuse auto pool on off True";
    let mut rng = Rng(1);
    for _ in 0..20_000 {
        let text: String = (0..rng.next() % 64)
            .map(|_| alphabet[(rng.next() as usize) % alphabet.len()] as char)
            .collect();
        fuzz::config(&text);
    }
}

#[test]
fn trace_reader_corpus_random_and_mutated_files() {
    let seeds = corpus("trace_file");
    for input in &seeds {
        fuzz::trace_file(input);
    }
    let mut rng = Rng(2);
    for _ in 0..3_000 {
        fuzz::trace_file(&rng.bytes(600));
        // A kept trace with a few bytes changed, cut, or extended.
        let mut bytes = seeds[(rng.next() as usize) % seeds.len()].clone();
        for _ in 0..(rng.next() % 4) {
            if !bytes.is_empty() {
                let at = (rng.next() as usize) % bytes.len();
                bytes[at] = rng.next() as u8;
            }
        }
        bytes.truncate((rng.next() as usize) % (bytes.len() + 1));
        fuzz::trace_file(&bytes);
    }
}

#[test]
fn allocator_operation_sequences() {
    for input in corpus("allocator_ops") {
        fuzz::allocator_ops(&input);
    }
    let mut rng = Rng(3);
    for _ in 0..400 {
        fuzz::allocator_ops(&rng.bytes(400));
    }
}
