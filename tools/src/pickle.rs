//! Python pickles (protocol 4) written from serde values, with shared values.
//!
//! What `cachealloc snapshot` writes its PyTorch snapshot with. The snapshot repeats the same
//! frames over and over: each `device_traces` entry and each block carries its stack's frames,
//! a window of 30 000 events with 55-frame stacks is 1.6 million frame dictionaries. Written
//! out each time they made a 126 MB pickle that took Python 1.4 s to load, which is what
//! `torch.cuda.memory_snapshot()` cost under the shim (BENCHMARKS.md, "memory snapshots").
//! PyTorch's own snapshot shares them: its symbolizer hands out one Python list per distinct
//! traceback. So does this writer: a value wrapped in [`Shared`] is pickled the first time and
//! memoized, and every later [`Shared`] of the same slice is a reference to it (`BINGET`), the
//! same Python object once loaded. serde-pickle, the crate this replaces, has no way to
//! express that.
//!
//! Supported: everything a snapshot is made of — booleans, integers (any size up to 128
//! bits), floats, strings, bytes, `None`/`Some`, sequences, tuples, maps and structs (dicts
//! keyed by field name), unit variants (their name). Other enum variants are an error.

use std::collections::HashMap;
use std::fmt::Display;
use std::io::Write;

use serde::ser::{self, Serialize};

/// The newtype name by which [`Shared`] tells the writer to share its value.
const SHARED: &str = "cachealloc::pickle::Shared";

/// A slice pickled once: every `Shared` of the same slice (the same memory, the same length)
/// in one pickle loads as the same Python list. Other serializers see the slice itself.
#[derive(Debug)]
pub struct Shared<'a, T>(pub &'a [T]);

// (Derived, these would ask `T: Copy`; a reference is copied whatever it refers to.)
impl<T> Clone for Shared<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Shared<'_, T> {}

impl<T: Serialize> Serialize for Shared<'_, T> {
    fn serialize<S: ser::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_newtype_struct(SHARED, self.0)
    }
}

/// Why a value could not be pickled.
#[derive(Debug)]
pub struct Error(String);

impl Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Error {}

impl ser::Error for Error {
    fn custom<T: Display>(msg: T) -> Self {
        Error(msg.to_string())
    }
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        Error(e.to_string())
    }
}

/// Pickle `value` to `out`.
pub fn to_writer<W: Write, T: Serialize + ?Sized>(out: W, value: &T) -> Result<(), Error> {
    let mut pickler = Pickler {
        out,
        shared: HashMap::new(),
        field_names: HashMap::new(),
        memo_len: 0,
    };
    pickler.out.write_all(&[op::PROTO, 4])?;
    value.serialize(&mut pickler)?;
    pickler.out.write_all(&[op::STOP])?;
    Ok(())
}

/// The opcodes written (CPython's `Lib/pickle.py` names).
mod op {
    pub const PROTO: u8 = 0x80;
    pub const STOP: u8 = b'.';
    pub const NONE: u8 = b'N';
    pub const NEWTRUE: u8 = 0x88;
    pub const NEWFALSE: u8 = 0x89;
    pub const BININT: u8 = b'J';
    pub const BININT1: u8 = b'K';
    pub const BININT2: u8 = b'M';
    pub const LONG1: u8 = 0x8a;
    pub const BINFLOAT: u8 = b'G';
    pub const SHORT_BINUNICODE: u8 = 0x8c;
    pub const BINUNICODE: u8 = b'X';
    pub const BINUNICODE8: u8 = 0x8d;
    pub const SHORT_BINBYTES: u8 = b'C';
    pub const BINBYTES: u8 = b'B';
    pub const BINBYTES8: u8 = 0x8e;
    pub const EMPTY_LIST: u8 = b']';
    pub const APPENDS: u8 = b'e';
    pub const EMPTY_DICT: u8 = b'}';
    pub const SETITEMS: u8 = b'u';
    pub const MARK: u8 = b'(';
    pub const TUPLE: u8 = b't';
    pub const MEMOIZE: u8 = 0x94;
    pub const BINGET: u8 = b'h';
    pub const LONG_BINGET: u8 = b'j';
}

/// The writer: the output and the shared values written so far.
struct Pickler<W> {
    out: W,
    /// Memo index of each shared slice written, by its address and size in bytes.
    shared: HashMap<(usize, usize), u32>,
    /// Memo index of each struct field name written (dict keys, as Python's pickler shares
    /// its interned keys), by its address and length (the linker may lay one name's bytes
    /// at the start of another's).
    field_names: HashMap<(usize, usize), u32>,
    /// Entries in the unpickler's memo so far (each `MEMOIZE` adds the next).
    memo_len: u32,
}

impl<W: Write> Pickler<W> {
    fn int(&mut self, v: i128) -> Result<(), Error> {
        match v {
            0..=0xff => self.out.write_all(&[op::BININT1, v as u8])?,
            0x100..=0xffff => {
                self.out.write_all(&[op::BININT2])?;
                self.out.write_all(&(v as u16).to_le_bytes())?;
            }
            _ if i32::try_from(v).is_ok() => {
                self.out.write_all(&[op::BININT])?;
                self.out.write_all(&(v as i32).to_le_bytes())?;
            }
            _ => {
                // The fewest little-endian two's-complement bytes that keep the sign.
                let bytes = v.to_le_bytes();
                let mut n = bytes.len();
                while n > 1 {
                    let (top, next) = (bytes[n - 1], bytes[n - 2]);
                    let redundant =
                        (top == 0 && next & 0x80 == 0) || (top == 0xff && next & 0x80 != 0);
                    if !redundant {
                        break;
                    }
                    n -= 1;
                }
                self.out.write_all(&[op::LONG1, n as u8])?;
                self.out.write_all(&bytes[..n])?;
            }
        }
        Ok(())
    }

    fn sized(&mut self, short: u8, long: u8, long8: u8, data: &[u8]) -> Result<(), Error> {
        if let Ok(n) = u8::try_from(data.len()) {
            self.out.write_all(&[short, n])?;
        } else if let Ok(n) = u32::try_from(data.len()) {
            self.out.write_all(&[long])?;
            self.out.write_all(&n.to_le_bytes())?;
        } else {
            self.out.write_all(&[long8])?;
            self.out.write_all(&(data.len() as u64).to_le_bytes())?;
        }
        self.out.write_all(data)?;
        Ok(())
    }

    /// Memoize the value on top of the unpickler's stack; returns its memo index.
    fn memoize(&mut self) -> Result<u32, Error> {
        self.out.write_all(&[op::MEMOIZE])?;
        self.memo_len += 1;
        Ok(self.memo_len - 1)
    }

    /// A struct's field name: written once, then referred to.
    fn field_name(&mut self, name: &'static str) -> Result<(), Error> {
        let key = (name.as_ptr() as usize, name.len());
        if let Some(&index) = self.field_names.get(&key) {
            return self.get(index);
        }
        ser::Serializer::serialize_str(&mut *self, name)?;
        let index = self.memoize()?;
        self.field_names.insert(key, index);
        Ok(())
    }

    fn get(&mut self, index: u32) -> Result<(), Error> {
        if let Ok(i) = u8::try_from(index) {
            self.out.write_all(&[op::BINGET, i])?;
        } else {
            self.out.write_all(&[op::LONG_BINGET])?;
            self.out.write_all(&index.to_le_bytes())?;
        }
        Ok(())
    }
}

/// A list, tuple or dict being written: whether its `MARK` is out yet (a container with no
/// items writes none).
pub struct Compound<'a, W> {
    pickler: &'a mut Pickler<W>,
    marked: bool,
    /// The opcode that ends the items (`APPENDS`, `SETITEMS` or `TUPLE`).
    close: u8,
}

impl<W: Write> Compound<'_, W> {
    fn item(&mut self) -> Result<&mut Pickler<W>, Error> {
        if !self.marked {
            self.pickler.out.write_all(&[op::MARK])?;
            self.marked = true;
        }
        Ok(self.pickler)
    }

    fn finish(self) -> Result<(), Error> {
        if self.marked {
            self.pickler.out.write_all(&[self.close])?;
        } else if self.close == op::TUPLE {
            // An empty tuple: MARK then TUPLE.
            self.pickler.out.write_all(&[op::MARK, op::TUPLE])?;
        }
        Ok(())
    }
}

impl<'a, W: Write> Pickler<W> {
    fn open(&'a mut self, start: Option<u8>, close: u8) -> Result<Compound<'a, W>, Error> {
        if let Some(start) = start {
            self.out.write_all(&[start])?;
        }
        Ok(Compound {
            pickler: self,
            marked: false,
            close,
        })
    }
}

fn unsupported(what: &str) -> Error {
    Error(format!("cannot pickle {what}"))
}

impl<'a, W: Write> ser::Serializer for &'a mut Pickler<W> {
    type Ok = ();
    type Error = Error;
    type SerializeSeq = Compound<'a, W>;
    type SerializeTuple = Compound<'a, W>;
    type SerializeTupleStruct = Compound<'a, W>;
    type SerializeTupleVariant = ser::Impossible<(), Error>;
    type SerializeMap = Compound<'a, W>;
    type SerializeStruct = Compound<'a, W>;
    type SerializeStructVariant = ser::Impossible<(), Error>;

    fn serialize_bool(self, v: bool) -> Result<(), Error> {
        Ok(self
            .out
            .write_all(&[if v { op::NEWTRUE } else { op::NEWFALSE }])?)
    }
    fn serialize_i8(self, v: i8) -> Result<(), Error> {
        self.int(v.into())
    }
    fn serialize_i16(self, v: i16) -> Result<(), Error> {
        self.int(v.into())
    }
    fn serialize_i32(self, v: i32) -> Result<(), Error> {
        self.int(v.into())
    }
    fn serialize_i64(self, v: i64) -> Result<(), Error> {
        self.int(v.into())
    }
    fn serialize_i128(self, v: i128) -> Result<(), Error> {
        self.int(v)
    }
    fn serialize_u8(self, v: u8) -> Result<(), Error> {
        self.int(v.into())
    }
    fn serialize_u16(self, v: u16) -> Result<(), Error> {
        self.int(v.into())
    }
    fn serialize_u32(self, v: u32) -> Result<(), Error> {
        self.int(v.into())
    }
    fn serialize_u64(self, v: u64) -> Result<(), Error> {
        self.int(v.into())
    }
    fn serialize_u128(self, v: u128) -> Result<(), Error> {
        self.int(i128::try_from(v).map_err(|_| unsupported("an integer of 128 bits"))?)
    }
    fn serialize_f32(self, v: f32) -> Result<(), Error> {
        self.serialize_f64(v.into())
    }
    fn serialize_f64(self, v: f64) -> Result<(), Error> {
        self.out.write_all(&[op::BINFLOAT])?;
        Ok(self.out.write_all(&v.to_be_bytes())?)
    }
    fn serialize_char(self, v: char) -> Result<(), Error> {
        self.serialize_str(v.encode_utf8(&mut [0; 4]))
    }
    fn serialize_str(self, v: &str) -> Result<(), Error> {
        self.sized(
            op::SHORT_BINUNICODE,
            op::BINUNICODE,
            op::BINUNICODE8,
            v.as_bytes(),
        )
    }
    fn serialize_bytes(self, v: &[u8]) -> Result<(), Error> {
        self.sized(op::SHORT_BINBYTES, op::BINBYTES, op::BINBYTES8, v)
    }
    fn serialize_none(self) -> Result<(), Error> {
        Ok(self.out.write_all(&[op::NONE])?)
    }
    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Result<(), Error> {
        value.serialize(self)
    }
    fn serialize_unit(self) -> Result<(), Error> {
        self.serialize_none()
    }
    fn serialize_unit_struct(self, _name: &'static str) -> Result<(), Error> {
        self.serialize_none()
    }
    fn serialize_unit_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
    ) -> Result<(), Error> {
        self.serialize_str(variant)
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        name: &'static str,
        value: &T,
    ) -> Result<(), Error> {
        let size = std::mem::size_of_val(value);
        if name != SHARED || size == 0 {
            return value.serialize(self);
        }
        // The slice's place in memory names it: every slice the pickled value borrows is
        // alive until the pickle is written, so no two distinct ones share a place and size.
        let key = (std::ptr::from_ref(value).cast::<()>() as usize, size);
        if let Some(&index) = self.shared.get(&key) {
            return self.get(index);
        }
        value.serialize(&mut *self)?;
        let index = self.memoize()?;
        self.shared.insert(key, index);
        Ok(())
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        _: &T,
    ) -> Result<(), Error> {
        Err(unsupported(variant))
    }
    fn serialize_seq(self, _len: Option<usize>) -> Result<Compound<'a, W>, Error> {
        self.open(Some(op::EMPTY_LIST), op::APPENDS)
    }
    fn serialize_tuple(self, _len: usize) -> Result<Compound<'a, W>, Error> {
        self.open(None, op::TUPLE)
    }
    fn serialize_tuple_struct(self, _: &'static str, len: usize) -> Result<Compound<'a, W>, Error> {
        self.serialize_tuple(len)
    }
    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        _: usize,
    ) -> Result<Self::SerializeTupleVariant, Error> {
        Err(unsupported(variant))
    }
    fn serialize_map(self, _len: Option<usize>) -> Result<Compound<'a, W>, Error> {
        self.open(Some(op::EMPTY_DICT), op::SETITEMS)
    }
    fn serialize_struct(self, _: &'static str, _len: usize) -> Result<Compound<'a, W>, Error> {
        self.open(Some(op::EMPTY_DICT), op::SETITEMS)
    }
    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        _: usize,
    ) -> Result<Self::SerializeStructVariant, Error> {
        Err(unsupported(variant))
    }
}

/// A list's, tuple's or tuple struct's items: each written after the container's `MARK`.
macro_rules! items {
    ($($trait:ident :: $method:ident),*) => {$(
        impl<W: Write> ser::$trait for Compound<'_, W> {
            type Ok = ();
            type Error = Error;
            fn $method<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Error> {
                value.serialize(self.item()?)
            }
            fn end(self) -> Result<(), Error> {
                self.finish()
            }
        }
    )*};
}

items!(
    SerializeSeq::serialize_element,
    SerializeTuple::serialize_element,
    SerializeTupleStruct::serialize_field
);

impl<W: Write> ser::SerializeMap for Compound<'_, W> {
    type Ok = ();
    type Error = Error;
    fn serialize_key<T: Serialize + ?Sized>(&mut self, key: &T) -> Result<(), Error> {
        key.serialize(self.item()?)
    }
    fn serialize_value<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Error> {
        value.serialize(self.item()?)
    }
    fn end(self) -> Result<(), Error> {
        self.finish()
    }
}

impl<W: Write> ser::SerializeStruct for Compound<'_, W> {
    type Ok = ();
    type Error = Error;
    fn serialize_field<T: Serialize + ?Sized>(
        &mut self,
        key: &'static str,
        value: &T,
    ) -> Result<(), Error> {
        let pickler = self.item()?;
        pickler.field_name(key)?;
        value.serialize(pickler)
    }
    fn end(self) -> Result<(), Error> {
        self.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pickle<T: Serialize + ?Sized>(value: &T) -> Vec<u8> {
        let mut out = vec![];
        to_writer(&mut out, value).unwrap();
        out
    }

    #[test]
    fn integers_take_the_shortest_opcode_and_keep_their_sign() {
        let body = |v: i64| {
            let p = pickle(&v);
            p[2..p.len() - 1].to_vec()
        };
        assert_eq!(body(7), [op::BININT1, 7]);
        assert_eq!(body(300), [op::BININT2, 44, 1]);
        assert_eq!(body(-1), [op::BININT, 0xff, 0xff, 0xff, 0xff]);
        assert_eq!(body(1 << 31), [op::LONG1, 5, 0, 0, 0, 0x80, 0]);
        assert_eq!(body(-(1 << 40)), [op::LONG1, 6, 0, 0, 0, 0, 0, 0xff]);
        let p = pickle(&u64::MAX);
        assert_eq!(
            p[2..p.len() - 1],
            [
                op::LONG1,
                9,
                0xff,
                0xff,
                0xff,
                0xff,
                0xff,
                0xff,
                0xff,
                0xff,
                0
            ]
        );
    }

    #[test]
    fn a_shared_slice_is_written_once_and_referred_to_after() {
        let frames = vec!["a".to_string(), "b".to_string()];
        let other = vec!["a".to_string(), "b".to_string()];
        let once = pickle(&vec![Shared(&frames)]);
        let thrice = pickle(&vec![Shared(&frames), Shared(&frames), Shared(&frames)]);
        // Two references (BINGET 0) more, and nothing else.
        assert_eq!(thrice.len(), once.len() + 4);
        assert_eq!(
            thrice.windows(2).filter(|w| *w == [op::BINGET, 0]).count(),
            2
        );
        // An equal slice elsewhere in memory is a list of its own.
        let two = pickle(&vec![Shared(&frames), Shared(&other)]);
        assert_eq!(two.iter().filter(|&&b| b == op::MEMOIZE).count(), 2);
        // An empty slice is never memoized.
        let empty: Vec<String> = vec![];
        let p = pickle(&vec![Shared(&empty), Shared(&empty)]);
        assert!(!p.contains(&op::MEMOIZE));
    }
}
